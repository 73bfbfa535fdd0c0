"""The coordinator's status page in a real browser: headless Chromium runs its script
against a live ``/api/status`` and the rendered DOM is checked: the plots with their axes,
the page before round 1, and after the run ends and the coordinator exits.

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
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest

from fedgrid.events import Event
from fedgrid.server.monitor import CoordinatorMonitor
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.status_page import STATUS_PATH, FinalStateHold
from fedgrid.types import ClientInfo, FitRes, RoundMetrics
from fedgrid.webserve import Response, Route, StatusServer

from harness import wait_until

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


def _plot(dom: str, name: str) -> str:
    match = re.search(rf'<svg id="plot-{name}"[^>]*>(.*?)</svg>', dom, re.S)
    assert match is not None, f"no plot {name} in the DOM"
    return match.group(1)


def _plot_points(dom: str, name: str) -> int:
    return len(re.findall(r"<circle\b", _plot(dom, name)))


def _axes(dom: str, name: str) -> tuple[list[str], list[str], list[str]]:
    """A plot's axis titles, its y tick labels (bottom up) and its x tick labels (the rounds)."""
    plot = _plot(dom, name)
    texts = lambda cls: re.findall(rf'<text class="{cls}"[^>]*>([^<]*)</text>', plot)  # noqa: E731
    return texts("axis-title"), texts("tick"), texts("tick round")


def _text(dom: str, element_id: str) -> str:
    match = re.search(rf'<[a-z]+ id="{element_id}"[^>]*>([^<]*)<', dom)
    assert match is not None, f"no #{element_id} in the DOM"
    return match.group(1)


def _round(r: int) -> RoundMetrics:
    return RoundMetrics(
        round=r,
        loss=1.0 / r,
        accuracy=0.5 + r / 10,
        bytes_up=40_000 * r,
        bytes_down=77_000,
        wall_s=0.1,
        clients_ok=1,
        clients_failed=0,
    )


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
    # The device, its accelerators and its memory, said to be memory.
    assert "<td>cuda x2, 80.0 GiB memory</td>" in dom and "<td>cpu</td>" in dom
    # A utilization cell per client (its split in the tooltip), and one per region.
    cells = re.findall(r'<td title="([^"]*)" class="utilization">([^<]*)</td>', dom)
    assert [v for _, v in cells] == ["0.60", "0.25", "0.60", "0.25"], dom[-3000:]
    assert cells[0][0] == "compute 6.0 s, comm 3.0 s, wait 1.0 s of 10.0 s"
    assert _plot_points(dom, "accuracy") == 3  # round 3 has none
    assert _plot_points(dom, "loss") == 4
    assert _plot_points(dom, "bytes") == 4
    assert 'data-points="3"' in dom
    # Axes: titles with units, round values with their unit, and the round numbers.
    assert _axes(dom, "accuracy") == (["accuracy (%)", "round"], ["60%", "70%", "80%", "90%"], list("1234"))
    assert _axes(dom, "loss") == (
        ["loss (mean per example)", "round"],
        ["0.2", "0.4", "0.6", "0.8", "1.0"],
        list("1234"),
    )
    assert _axes(dom, "bytes") == (
        ["bytes (up + down)", "round"],
        ["0 kB", "2 kB", "4 kB", "6 kB"],
        list("1234"),
    )
    assert "<title>round 4: 4.5 kB</title>" in _plot(dom, "bytes")  # each point's tooltip
    assert _text(dom, "last-accuracy") == "(round 4: 90.0%)" and _text(dom, "last-loss") == "(round 4: 0.25)"
    assert "e+" not in dom  # no exponent anywhere
    assert _text(dom, "banner") == ""  # running, rounds committed: nothing to say
    shot = tmp_path / "status.png"
    _browse(tmp_path, url, "--virtual-time-budget=5000", f"--screenshot={shot}", "--window-size=1200,900")
    assert _png_size(shot) == (1200, 900)


def test_status_page_without_the_token_shows_the_refusal(tmp_path, live_status):
    dom = _browse(tmp_path, live_status, "--virtual-time-budget=5000", "--dump-dom").stdout
    assert "cannot read /api/status: HTTP 401" in dom
    assert '<strong id="round">-</strong>' in dom
    assert "plain" not in dom


def test_status_page_before_round_1_says_it_is_waiting(tmp_path):
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    fleet.join(ClientInfo("", name="first", region="eu-west", num_examples=3))
    monitor = CoordinatorMonitor(fleet, rounds=6, history=lambda: [])
    server = StatusServer("127.0.0.1:0", monitor.routes()).start()
    try:
        dom = _browse(
            tmp_path, f"http://{server.address}/", "--virtual-time-budget=2000", "--dump-dom"
        ).stdout
    finally:
        server.stop()
        fleet.close()
    assert _text(dom, "banner") == "waiting for round 1 (1 client joined)", dom[:3000]
    assert '<strong id="round">0 / 6</strong>' in dom and "first" in dom
    for name in ("accuracy", "loss", "bytes"):
        assert re.findall(r'<text class="empty"[^>]*>([^<]*)</text>', _plot(dom, name)) == [
            "waiting for round 1"
        ]
        assert _plot_points(dom, name) == 0 and "<polyline" not in _plot(dom, name)
        assert _axes(dom, name)[0][1] == "round"  # the frame is labelled, empty or not
    assert dom.count('data-points="0"') == 3


def test_status_page_keeps_the_final_state_after_the_coordinator_exits(tmp_path):
    """The page watches rounds 1-3 of 4; on its second read the last round commits and the run
    finishes. The coordinator holds its final state (``FinalStateHold``, as ``run_coordinator``
    does) until the page's next read, then stops serving: the page keeps what it drew last and
    says the run finished and the coordinator is gone."""
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    fleet.join(ClientInfo("", name="w", region="eu-west", num_examples=3))
    history = [_round(r) for r in (1, 2, 3)]
    monitor = CoordinatorMonitor(fleet, rounds=4, history=lambda: list(history))
    monitor.on_event(Event("started", time.time(), {}))
    status = monitor.routes()[STATUS_PATH].handler
    reads: list[int] = []

    def scripted() -> Response:  # by read: the run ends during the second, the server is gone from the fourth
        reads.append(len(reads) + 1)
        if reads[-1] == 2:
            history.append(_round(4))
            monitor.on_event(Event("finished", time.time(), {"rounds": 4}))
        if reads[-1] >= 4:  # the server is being stopped: refused, or this
            return Response(b"gone\n", status=503)
        return status()

    hold = FinalStateHold(lambda: monitor.state == "finished", limit_s=60)
    server = StatusServer(
        "127.0.0.1:0", hold.routes({**monitor.routes(), STATUS_PATH: Route(scripted)})
    ).start()
    url, stopped = f"http://{server.address}/", False
    try:
        with ThreadPoolExecutor(1) as pool:  # polls at 0, 3, 6 and 9 s of the page's virtual time
            page = pool.submit(_browse, tmp_path, url, "--virtual-time-budget=11000", "--dump-dom")
            wait_until(lambda: monitor.state == "finished" or page.done(), timeout=120, what="the run's end")
            waited = hold.wait()  # as the coordinator does before it stops its status server
            assert waited < 60 and len(reads) >= 3  # ended by the page's read of the final state
            server.stop()  # the coordinator exits
            stopped = True
            dom = page.result(timeout=120).stdout
    finally:
        if not stopped:
            server.stop()
        fleet.close()
    assert len(reads) >= 3
    banner = re.search(r'<p id="banner" data-state="([a-z]+)">([^<]*)</p>', dom)
    assert banner is not None, dom[:3000]
    assert banner.group(1) == "ended"
    assert banner.group(2).startswith(
        "run finished: 4 of 4 rounds committed; the coordinator no longer answers (it has exited): "
        "this is the run's final state, read at "
    )
    assert "<title>fedgrid: ended</title>" in dom
    assert _text(dom, "error").startswith("cannot read /api/status: ")
    # The final state stays drawn: round 4 of 4 in every plot and the round line.
    assert '<strong id="round">4 / 4</strong>' in dom and _text(dom, "state") == "finished"
    for name in ("accuracy", "loss", "bytes"):
        assert _plot_points(dom, name) == 4 and _axes(dom, name)[2] == list("1234")
    assert _text(dom, "last-bytes") == "(round 4: 237 kB)"
    assert "w" in re.findall(r"<td>([^<]*)</td>", dom)  # the clients table too
