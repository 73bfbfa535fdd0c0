"""The coordinator's status page in a real browser: headless Chromium runs its script
against a live ``/api/status`` and the rendered DOM is checked.

Chromium is a system package (Debian's ``chromium``); ``make test`` installs it when it runs
as root. Without it the test is skipped on a developer machine with the reason printed, and
fails under CI (``CI=true``), where it must run.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path

import pytest

from fedgrid.server.monitor import CoordinatorMonitor
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.types import ClientInfo, FitRes, RoundMetrics
from fedgrid.webserve import StatusServer

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TOKEN = "page-token-0123456789abcdef"


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        reason = (
            "Debian's chromium is not installed (make test installs it as root: apt-get install chromium)"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must render the status page: {reason}")
        pytest.skip(reason)
    return path


def _browse(tmp_path: Path, url: str, *extra: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    profile.mkdir()
    return subprocess.run(
        [_chromium(), *FLAGS, f"--user-data-dir={profile}", *extra, url],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def _plot_points(dom: str, name: str) -> int:
    match = re.search(rf'<svg id="plot-{name}"[^>]*>(.*?)</svg>', dom, re.S)
    assert match is not None, f"no plot {name} in the DOM"
    return len(re.findall(r"<circle\b", match.group(1)))


@pytest.fixture
def live_status(tmp_path):
    """A monitor over a fleet with two joined clients (one named with HTML) and four rounds
    of history, round 3 without an accuracy (a failed round), the clients' last fit splits,
    served on loopback with a token."""
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    bold, _ = fleet.join(ClientInfo("", name="<b>bold</b> client", region="eu-west", num_examples=3))
    plain, _ = fleet.join(
        ClientInfo(
            "",
            name="plain",
            region="us-east",
            num_examples=3,
            device="cuda",
            num_accelerators=2,
            memory_bytes=80 << 30,
        )
    )
    history = [
        RoundMetrics(
            round=r,
            loss=1.0 / r,
            accuracy=None if r == 3 else 0.5 + r / 10,
            bytes_up=1000 * r,
            bytes_down=500,
            wall_s=0.1,
            clients_ok=2,
            clients_failed=0,
        )
        for r in range(1, 5)
    ]
    monitor = CoordinatorMonitor(fleet, rounds=6, history=lambda: history)
    split = dict(wall_s=10.0, comm_s=3.0, wait_s=1.0, transfer_s=3.0)
    monitor.on_fit_results(
        [
            FitRes(bold, OrderedDict(), 3, {**split, "compute_s": 6.0, "utilization": 0.6}),
            FitRes(plain, OrderedDict(), 3, {**split, "compute_s": 2.5, "utilization": 0.25}),
        ]
    )
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    server = StatusServer("127.0.0.1:0", monitor.routes(), token_file=str(token_file)).start()
    yield f"http://{server.address}/"
    server.stop()
    fleet.close()


def test_status_page_renders_round_plots_and_escaped_clients(tmp_path, live_status):
    url = f"{live_status}#token={TOKEN}"
    dom = _browse(tmp_path, url, "--virtual-time-budget=5000", "--dump-dom").stdout
    assert '<strong id="round">4 / 6</strong>' in dom, dom[:3000]
    # The name arrived as text: its markup is escaped in the DOM, not an element.
    assert "&lt;b&gt;bold&lt;/b&gt; client" in dom
    assert "<b>bold</b>" not in dom
    assert "plain" in dom and "eu-west" in dom and "idle" in dom
    assert "<td>cuda x2, 80.0 GiB</td>" in dom and "<td>cpu</td>" in dom  # device, accelerators, memory
    # A utilization cell per client (its split in the tooltip), and one per region.
    cells = re.findall(r'<td title="([^"]*)" class="utilization">([^<]*)</td>', dom)
    assert [v for _, v in cells] == ["0.60", "0.25", "0.60", "0.25"], dom[-3000:]
    assert cells[0][0] == "compute 6.0 s, comm 3.0 s, wait 1.0 s of 10.0 s"
    assert _plot_points(dom, "accuracy") == 3  # round 3 has none
    assert _plot_points(dom, "loss") == 4
    assert _plot_points(dom, "bytes") == 4
    assert 'data-points="3"' in dom
    shot = tmp_path / "status.png"
    _browse(tmp_path, url, "--virtual-time-budget=5000", f"--screenshot={shot}", "--window-size=1200,900")
    assert _png_size(shot) == (1200, 900)


def test_status_page_without_the_token_shows_the_refusal(tmp_path, live_status):
    dom = _browse(tmp_path, live_status, "--virtual-time-budget=5000", "--dump-dom").stdout
    assert "cannot read /api/status: HTTP 401" in dom
    assert '<strong id="round">-</strong>' in dom
    assert "plain" not in dom
