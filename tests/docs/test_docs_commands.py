"""Every command of the documentation is checked: each shell block of ``docs/*.rst`` and
``README.md`` is marked (``support/doc_blocks.py``), and each block marked ``runs`` runs here as
written, as a user runs it from the repository's root, on a 2-core CPU in under 3 minutes
(``BUDGET_S``) and with exit status 0. Blocks marked ``run by PATH`` name a test that runs them;
those marked ``not run`` say why (a placeholder, another machine, Docker, GPUs);
``tests/e2e/test_docs.py`` checks that every block has a mark.

This is a tier of its own (``make test-docs``; ``.ci/run`` runs it after ``make test``): the
blocks are whole trainings, about 4 minutes of CPU time together. The blocks run two at a time
(``-n 2``), each in a folder and a network namespace of its own.
"""

from __future__ import annotations

import re
import time

import pytest
from doc_blocks import COMMAND, ROOT, RUNS, Block, blocks, prepare, run_block

#: Seconds a command may take: "under 3 minutes on a 2-core CPU" (a block: this times its commands).
BUDGET_S = 180
#: Data that ``../shared/data`` holds on the development machines (``docs/simulation.rst``).
SHARED_DATA = re.compile(r"\.\./shared/data/([\w-]+)")

RUNNING = [b for b in blocks() if b.mark == RUNS]


@pytest.mark.parametrize("block", RUNNING, ids=[b.id for b in RUNNING])
def test_a_docs_block_marked_runs_finishes_as_written_in_under_3_minutes(block: Block, tmp_path):
    missing = [
        name
        for name in SHARED_DATA.findall(block.text)
        if not (ROOT.parent / "shared" / "data" / name).is_dir()
    ]
    if missing:
        pytest.skip(f"this machine has no ../shared/data/{missing[0]} (the development machines' data)")
    repo = prepare(tmp_path)
    budget = BUDGET_S * sum(1 for line in block.text.splitlines() if COMMAND.match(line))
    began = time.monotonic()
    result = run_block(block, repo, timeout=budget)
    took = time.monotonic() - began
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert took < budget, f"{block.id} took {took:.0f} s"
