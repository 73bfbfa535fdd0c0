"""How ``ParallelClient`` starts its ranks: forked from a forkserver that imported torch once.

A forked rank's process parent is the forkserver, and the forkserver's environment is the one
it started with; ``parallel_ranks.forked_rank`` and ``_watch`` make up for both. A real
process plays rank 0 (``support/rank_probe.py``) and exits without stopping its rank, as a
SIGKILLed client would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from harness import child_env, wait_until

PROBE = Path(__file__).resolve().parents[1] / "support" / "rank_probe.py"


def test_a_forked_rank_has_rank_0s_environment_and_exits_once_rank_0_is_gone(tmp_path):
    out = tmp_path / "seen.json"
    done = subprocess.run([sys.executable, str(PROBE), str(out)], env=child_env(), timeout=120, check=False)
    assert done.returncode == 0
    # The mark was set after the forkserver started: only the handed-over environment carries
    # it. The rank's process parent is the forkserver, yet the watch sees rank 0 alive.
    assert json.loads(out.read_text()) == {"mark": "set-late", "alive": True, "forked": True}
    gone = Path(str(out) + ".gone")
    wait_until(gone.exists, timeout=30, what="the forked rank to notice that rank 0 exited")
    assert gone.read_text() == "gone"
