"""What a rank forked by ``ParallelClient``'s forkserver sees (``tests/e2e/test_rank_start.py``).

``python rank_probe.py OUT`` starts one process the way ``ParallelClient`` starts its ranks,
waits for its first report, then exits at once without stopping it: the process must notice
that its starter is gone (``parallel_ranks._watch``) and write ``gone`` to ``OUT.gone``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path

from harness import wait_until


def report(out: str, parent: int) -> None:
    """In the forked process: the environment mark and the watch's view, then wait for rank 0 to go."""
    from fedgrid.client.parallel_ranks import _watch

    alive = _watch(parent)
    seen = {"mark": os.environ.get("FEDGRID_PROBE_MARK"), "alive": alive(), "forked": os.getppid() != parent}
    Path(out + ".tmp").write_text(json.dumps(seen))
    os.replace(out + ".tmp", out)
    # Block on the starter's sentinel (what the watch reads) until it closes, 60 s at most.
    multiprocessing.parent_process().join(timeout=60)  # type: ignore[union-attr]
    Path(out + ".gone").write_text("gone" if not alive() else "still alive at the deadline")


def start(out: str, mark: str) -> "object":
    """Starts ``report`` as ``ParallelClient._start`` starts a rank; the mark is set after the
    forkserver started, so only the environment handed over can carry it."""
    from multiprocessing import forkserver

    from fedgrid.client.parallel_ranks import forked_rank, rank_context

    context = rank_context(report)
    forkserver.ensure_running()
    os.environ["FEDGRID_PROBE_MARK"] = mark
    process = context.Process(
        target=forked_rank, args=(dict(os.environ), report, out, os.getpid()), daemon=False
    )
    process.start()
    return process


if __name__ == "__main__":
    target = sys.argv[1]
    start(target, "set-late")
    wait_until(lambda: os.path.exists(target), timeout=60, what="the forked process's report")
    os._exit(0)  # no join, no cleanup: as a SIGKILLed rank 0 leaves its ranks
