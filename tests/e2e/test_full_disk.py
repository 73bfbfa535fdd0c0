"""A full disk under the state directory stops the coordinator with one line naming the path and
the free space; its clients wait (UNAVAILABLE is transient), and once space is freed a restart
ends on the uninterrupted run's model bit for bit, each round once (issue 26, item 4).

The disk fills at a documented event (``apps/event_coordinator.py``'s ``ENOSPC`` fault,
``support/full_disk.py``): once during an upload's spill, once during a checkpoint.
"""

from __future__ import annotations

import sqlite3

from fedgrid.runlog import read_metrics

from harness import (
    REFERENCE_ARGS,
    REFERENCE_CLIENTS,
    REFERENCE_ROUNDS,
    REFERENCE_SEED,
    CoordinatorRun,
    Relay,
    assert_same_model,
    start_client,
)

#: (round, event) at which the disk fills: mid-upload (the spill), and mid-commit (the checkpoint).
FAULTS = [(3, "update_accepted"), (6, "checkpoint_writing")]


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def test_a_full_disk_stops_with_one_line_and_a_restart_ends_bit_identical(tmp_path, reference_deployment):
    reference = reference_deployment(REFERENCE_ARGS, clients=REFERENCE_CLIENTS, seed=REFERENCE_SEED)
    out, state = tmp_path / "run", tmp_path / "state"
    common = [*REFERENCE_ARGS, "--state-dir", str(state)]
    relay = Relay(None)
    logs = [tmp_path / f"coordinator{i}.log" for i in range(len(FAULTS) + 1)]
    runs = [CoordinatorRun(out, common, logs[0], trigger=FAULTS[0], sig="ENOSPC")]
    relay.retarget(_port(runs[0].address()))
    clients = [
        start_client(
            relay.address,
            tmp_path / f"client{i}.log",
            "--partition",
            f"{i}/{REFERENCE_CLIENTS}",
            "--seed",
            str(REFERENCE_SEED),
        )
        for i in range(REFERENCE_CLIENTS)
    ]
    try:
        for i, fault in enumerate([*FAULTS[1:], None], start=1):
            # The disk is full: the coordinator stops by itself, with status 1.
            assert runs[-1].proc.wait(timeout=180) == 1, logs[i - 1].read_text()[-3000:]
            relay.retarget(None)
            assert all(c.poll() is None for c in clients)  # they wait for it
            # Space is freed (the fault ends with the process): the restart resumes.
            runs.append(CoordinatorRun(out, common, logs[i], trigger=fault, sig="ENOSPC"))
            relay.retarget(_port(runs[-1].address()))
        assert runs[-1].proc.wait(timeout=240) == 0, logs[-1].read_text()[-3000:]
        for i, c in enumerate(clients):
            assert c.wait(timeout=60) == 0, (tmp_path / f"client{i}.log").read_text()[-3000:]
    finally:
        for p in [*(r.proc for r in runs), *clients]:
            if p.poll() is None:
                p.kill()
        relay.close()

    for run, log, (fault_round, _) in zip(runs, logs, FAULTS):
        text = log.read_text()
        lines = [line for line in text.splitlines() if "storage error" in line]
        assert len(lines) == 1 and lines[0].startswith("fedgrid: error: storage error writing "), text[-3000:]
        assert str(state) in lines[0] and "No space left on device" in lines[0] and "MiB free of" in lines[0]
        assert "Traceback" not in text and "OperationalError" not in text
        failed = run.seen("round_failed")
        assert [e["round"] for e in failed] == [fault_round] and "storage error" in failed[0]["reason"]
        assert fault_round not in [e["round"] for e in run.seen("round_committed")]
    assert [len(r.seen("resumed")) for r in runs] == [0, 1, 1]
    assert not list(state.glob("*.tmp"))
    assert [m["round"] for m in read_metrics(out)] == list(range(1, REFERENCE_ROUNDS + 1))
    with sqlite3.connect(state / "history.sqlite") as db:
        assert [r[0] for r in db.execute("SELECT round FROM rounds ORDER BY round")] == list(
            range(1, REFERENCE_ROUNDS + 1)
        )
    assert_same_model(out, reference)
