"""``fedgrid launch`` on a terminal (issue 40, item 4): one line rewritten in place says which
global round runs, for how long, and about how long the run has left; a round's status line
waits for its row's accuracy (the coordinator evaluates beside the next round)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from fedgrid.ops.launch import Launcher, load_topology

TOPOLOGY = Path(__file__).resolve().parents[3] / "docker" / "topology.toml"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _row(r: int, accuracy: float | None) -> str:
    return json.dumps(
        {"round": r, "loss": 0.5, "accuracy": accuracy, "bytes_up": 10, "bytes_down": 20, "wall_s": 30.0}
        | {"clients_ok": 2, "clients_failed": 0}
    )


def test_the_bar_names_the_running_round_and_the_time_left(tmp_path):
    stream = _Terminal()
    launcher = Launcher(load_topology(TOPOLOGY, rounds=3), tmp_path / "out", stream=stream)
    launcher._began = launcher._round_began = 100.0
    launcher.bar(112.0)
    assert stream.getvalue() == "\rfedgrid launch: global round 1/3 running for 0:00:12\033[K"
    (tmp_path / "out" / "global").mkdir(parents=True)
    metrics = tmp_path / "out" / "global" / "metrics.jsonl"
    metrics.write_text(_row(1, None) + "\n")
    launcher._print_rounds()  # round 1's row has no accuracy yet: its line waits
    assert launcher.rounds_done == 0
    metrics.write_text(_row(1, 0.75) + "\n")  # rewritten with its evaluation
    stream.seek(0), stream.truncate()
    launcher._print_rounds()
    assert launcher.rounds_done == 1
    assert stream.getvalue().startswith(
        "\r\033[Kfedgrid launch: global round 1/3: loss 0.5000, accuracy 0.7500;"
    )
    launcher._began, launcher._round_began = 100.0, 160.0  # round 1 took 60 s
    stream.seek(0), stream.truncate()
    launcher.bar(175.0)
    assert stream.getvalue() == (
        "\rfedgrid launch: global round 2/3 running for 0:00:15, about 0:01:45 left\033[K"
    )


def test_no_bar_off_a_terminal(tmp_path):
    stream = io.StringIO()
    launcher = Launcher(load_topology(TOPOLOGY, rounds=3), tmp_path / "out", stream=stream)
    launcher.bar(launcher._began + 30.0)
    assert stream.getvalue() == ""
