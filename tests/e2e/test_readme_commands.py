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
import subprocess
from pathlib import Path

from doc_blocks import runner, venv

ROOT = Path(__file__).resolve().parents[2]
MARK = "<!-- quickstart: runs -->"


def _blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(re.escape(MARK) + r"\n```sh\n(.*?)```", text, re.S)


def _rounds(run_dir: Path) -> list[tuple[int, int]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["round"], row["clients_ok"]) for row in rows]


def test_every_quickstart_block_of_the_readme_runs_as_written(tmp_path):
    blocks = _blocks()
    assert len(blocks) == 2, "the README's quickstart lost its marked blocks"
    assert blocks[0].startswith("source .venv/bin/activate")
    venv(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outputs = []
    for block in blocks:
        body = (
            block if block.startswith("source ") else "source .venv/bin/activate\n" + block
        )  # one shell each
        result = subprocess.run(
            runner(body, tmp_path), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
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
