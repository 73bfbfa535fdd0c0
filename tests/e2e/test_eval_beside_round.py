"""Evaluation never holds a round (issue 40, item 2), in real processes: a coordinator whose
server-side evaluation takes 3 s more opens round 2's tasks before round 1's evaluation ends, and
round 1's figures still land in round 1's row of ``metrics.jsonl``."""

from __future__ import annotations

from fedgrid.runlog import read_metrics

from harness import CoordinatorRun, start_client


def test_a_slow_evaluation_runs_beside_the_next_round_and_lands_in_its_own_row(tmp_path):
    out, log_path = tmp_path / "run", tmp_path / "coordinator.log"
    args = ["--rounds", "2", "--min-clients", "2", "--seed", "5"]
    run = CoordinatorRun(out, args, log_path, env={"SLOW_EVAL_S": "3"})
    clients = [
        start_client(run.address(), tmp_path / f"c{i}.log", "--partition", f"{i}/2", "--seed", "5")
        for i in range(2)
    ]
    try:
        assert run.proc.wait(timeout=180) == 0, log_path.read_text()[-3000:]
        for i, c in enumerate(clients):
            assert c.wait(timeout=60) == 0, (tmp_path / f"c{i}.log").read_text()[-2000:]
    finally:
        for p in [run.proc, *clients]:
            if p.poll() is None:
                p.kill()
    events = [(e["event"], e.get("round")) for e in run.seen("round_opened") + run.seen("evaluated")]
    order = [(e["event"], e.get("round")) for e in run.events if (e["event"], e.get("round")) in events]
    # Round 2's tasks went out while round 1's evaluation still ran (3 s), not after it.
    assert order.index(("round_opened", 2)) < order.index(("evaluated", 1)), order
    seconds = {e["round"]: e["seconds"] for e in run.seen("evaluated")}
    assert set(seconds) == {1, 2} and min(seconds.values()) >= 3.0
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [1, 2]
    assert all(isinstance(r["accuracy"], float) and 0.0 <= r["accuracy"] <= 1.0 for r in rows), rows
    # The figures are the evaluation's (its loss), in the row of the round each measured.
    assert [r["loss"] for r in rows] == [
        e["loss"] for e in sorted(run.seen("evaluated"), key=lambda e: e["round"])
    ]
