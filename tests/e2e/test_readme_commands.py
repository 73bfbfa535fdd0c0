"""The README's quickstart runs as written on one machine: every shell block marked
``<!-- quickstart: runs -->`` is run verbatim by bash, from a folder holding ``.venv`` (the
environment running the tests), and must leave the run directories it promises.

The commands use the coordinator's default port, 50051. They run in a network namespace of
their own (``unshare -rn``: a private loopback), so nothing else on the machine can hold that
port; where namespaces are not available, the one change made to the text is that port,
swapped for a free one (``_runner``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = "<!-- quickstart: runs -->"


def _blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(re.escape(MARK) + r"\n```sh\n(.*?)```", text, re.S)


def _venv(folder: Path) -> None:
    """``folder/.venv``: the tests' own environment (a venv's activate script), else a stand-in
    that puts the directory of the ``fedgrid`` script on PATH."""
    prefix = Path(sys.prefix)
    if (prefix / "bin" / "activate").is_file():
        (folder / ".venv").symlink_to(prefix, target_is_directory=True)
        return
    script = shutil.which("fedgrid") or str(Path(sys.executable).parent / "fedgrid")
    (folder / ".venv" / "bin").mkdir(parents=True)
    (folder / ".venv" / "bin" / "activate").write_text(f'export PATH="{Path(script).parent}:$PATH"\n')


def _namespaces() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    probe = subprocess.run(["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True)
    return probe.returncode == 0


def _runner(block: str, folder: Path) -> list[str]:
    """The command that runs ``block`` verbatim in a private network namespace, or, without
    one, with port 50051 swapped for a free one."""
    script = folder / "block.sh"
    if _namespaces():
        script.write_text(block)
        return ["unshare", "-rn", "sh", "-c", "ip link set lo up && exec bash -e block.sh"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script.write_text(
        block.replace("127.0.0.1:50051", f"127.0.0.1:{port}").replace(
            "fedgrid coordinator ", f"fedgrid coordinator --listen 127.0.0.1:{port} "
        )
    )
    return ["bash", "-e", "block.sh"]


def _rounds(run_dir: Path) -> list[tuple[int, int]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["round"], row["clients_ok"]) for row in rows]


def test_every_quickstart_block_of_the_readme_runs_as_written(tmp_path):
    blocks = _blocks()
    assert len(blocks) == 2, "the README's quickstart lost its marked blocks"
    assert blocks[0].startswith("source .venv/bin/activate")
    _venv(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outputs = []
    for block in blocks:
        body = (
            block if block.startswith("source ") else "source .venv/bin/activate\n" + block
        )  # one shell each
        result = subprocess.run(
            _runner(body, tmp_path), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        outputs.append(result.stdout + result.stderr)
    runs = tmp_path / "runs"
    assert [r for r, _ in _rounds(runs / "sim")] == [1, 2, 3]
    for name in ("coord", "tls"):  # two clients in every round, deployed plaintext on loopback, then mTLS
        assert _rounds(runs / name) == [(1, 2), (2, 2), (3, 2)], outputs
        assert (runs / name / "model.safetensors").stat().st_size > 0
    assert "plaintext on loopback address 127.0.0.1" in outputs[0]
    assert "mutual TLS: clients need a certificate of pki/ca.pem" in outputs[1]
    assert "Traceback" not in "".join(outputs)
