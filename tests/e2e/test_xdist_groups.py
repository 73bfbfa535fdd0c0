"""``--dist loadgroup`` keeps the tests of one ``xdist_group`` on one worker, as ``make test``
relies on: the docs build and each reference deployment are made once per group, not once per
worker. pytest 9 broke it silently with pytest-xdist 3.8 (node ids from a structure xdist does
not suffix), hence the pin in pyproject.toml; this test says so if it breaks again."""

from __future__ import annotations

import subprocess
import sys

from harness import child_env

SUITE = """
import os
import pathlib

import pytest

def record(name):
    (pathlib.Path(os.environ["GROUP_SEEN"]) / name).write_text(os.environ["PYTEST_XDIST_WORKER"])

{tests}
"""


def test_the_tests_of_one_xdist_group_run_on_one_worker(tmp_path):
    seen = tmp_path / "seen"
    seen.mkdir()
    tests = "\n".join(
        ('@pytest.mark.xdist_group("g")\n' if i % 2 == 0 else "")
        + f"def test_{i}():\n    record('{'g' if i % 2 == 0 else 'x'}{i}')\n"
        for i in range(40)
    )
    (tmp_path / "test_grouped.py").write_text(SUITE.format(tests=tests))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
         "test_grouped.py"],
        cwd=tmp_path, env={**child_env(), "GROUP_SEEN": str(seen)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    workers = {p.name: p.read_text() for p in seen.iterdir()}
    assert len(workers) == 40, workers
    grouped = {w for name, w in workers.items() if name.startswith("g")}
    assert len(grouped) == 1, workers  # all twenty on one worker
    assert set(workers.values()) == {"gw0", "gw1"}  # and the others were spread over both
