"""SIGKILL the coordinator at seeded moments; the run still ends bit-identical to an
uninterrupted deployment, each round once.

Kills fire on the coordinator's documented events (``fedgrid.events``), and every start
binds a new ephemeral port behind a relay that keeps the clients' address fixed.
"""

from __future__ import annotations

import random
import signal
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
    wait_until,
)

# The shared reference deployment's run (tests/conftest.py), killed five times at seeded moments.
ROUNDS, CLIENTS, SEED, KILLS = REFERENCE_ROUNDS, REFERENCE_CLIENTS, REFERENCE_SEED, 5
PHASES = {"upload": "update_accepted", "aggregate": "aggregating", "checkpoint": "checkpoint_writing"}


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def run_with_kills(
    tmp_path, common: list[str], schedule: list[tuple[int, str]], *, clients: int, seed: int
) -> list[CoordinatorRun]:
    """A coordinator SIGKILLed at each ``(round, event)`` of ``schedule`` and restarted on a
    new port behind a relay, until it finishes; ``clients`` client processes throughout."""
    out, log_path = tmp_path / "run", tmp_path / "coordinator.log"
    relay = Relay(None)
    triggers: list[tuple[int, str] | None] = [*schedule, None]
    runs = [CoordinatorRun(out, common, log_path, trigger=triggers[0])]
    relay.retarget(_port(runs[0].address()))
    procs = [
        start_client(
            relay.address, tmp_path / f"client{i}.log", "--partition", f"{i}/{clients}", "--seed", str(seed)
        )
        for i in range(clients)
    ]
    try:
        for trigger in triggers[1:]:
            current = runs[-1]
            wait_until(
                lambda: current.killed.is_set() or current.proc.poll() is not None,
                timeout=120,
                what=f"kill at {current.trigger}",
            )
            assert current.killed.is_set(), f"run ended before the kill at {current.trigger}"
            assert current.proc.wait(timeout=30) == -signal.SIGKILL
            relay.retarget(None)  # down: connections are refused until the restart listens
            runs.append(CoordinatorRun(out, common, log_path, trigger=trigger))
            relay.retarget(_port(runs[-1].address()))
        assert runs[-1].proc.wait(timeout=240) == 0, log_path.read_text()[-3000:]
        for i, c in enumerate(procs):
            assert c.wait(timeout=60) == 0, (tmp_path / f"client{i}.log").read_text()[-3000:]
    finally:
        for p in [*(r.proc for r in runs), *procs]:
            if p.poll() is None:
                p.kill()
        relay.close()
    return runs


def test_sigkill_at_random_moments_changes_nothing(tmp_path, reference_deployment):
    rng = random.Random(SEED)
    # One kill in each phase, the rest anywhere; rounds drawn from the seed, in run order.
    phases = list(PHASES) + rng.choices(list(PHASES), k=KILLS - len(PHASES))
    schedule = [(r, PHASES[p]) for r, p in sorted(zip(sorted(rng.sample(range(1, ROUNDS), KILLS)), phases))]
    common = REFERENCE_ARGS
    reference = reference_deployment(common, clients=CLIENTS, seed=SEED)

    state = tmp_path / "state"
    runs = run_with_kills(
        tmp_path, [*common, "--state-dir", str(state)], schedule, clients=CLIENTS, seed=SEED
    )
    assert len(runs) == KILLS + 1 and all(r.killed.is_set() for r in runs[:-1])
    # Every restart resumes from a checkpoint (a kill before round 1 committed would not).
    assert sum(len(r.seen("resumed")) for r in runs) == KILLS
    out = tmp_path / "run"
    assert [m["round"] for m in read_metrics(out)] == list(range(1, ROUNDS + 1))
    with sqlite3.connect(state / "history.sqlite") as db:
        assert [r[0] for r in db.execute("SELECT round FROM rounds ORDER BY round")] == list(
            range(1, ROUNDS + 1)
        )
    # Each kill landed inside the phase its event opens: the killed round was not committed by that start.
    for run in runs[:-1]:
        killed_round = run.seen(run.trigger[1])[-1]["round"]
        assert killed_round not in [e["round"] for e in run.seen("round_committed")]
    assert_same_model(out, reference)


def test_fedadam_coordinator_killed_and_resumed_ends_bit_identical(tmp_path, reference_deployment):
    """SIGKILL mid-aggregation and mid-upload: the server optimizer's moments come back from
    the checkpoint, so the resumed run ends with exactly the uninterrupted model."""
    rounds, clients, seed = 5, 3, 5
    common = [
        "--rounds",
        str(rounds),
        "--min-clients",
        str(clients),
        "--seed",
        str(seed),
        "--heartbeat-interval-s",
        "2",
        "--strategy",
        "fedadam",
        "--server-lr",
        "0.03",
    ]
    reference = reference_deployment(common, clients=clients, seed=seed)
    runs = run_with_kills(
        tmp_path,
        [*common, "--state-dir", str(tmp_path / "state")],
        [(2, "aggregating"), (4, "update_accepted")],
        clients=clients,
        seed=seed,
    )
    assert [len(r.seen("resumed")) for r in runs] == [0, 1, 1]
    assert [m["round"] for m in read_metrics(tmp_path / "run")] == list(range(1, rounds + 1))
    assert_same_model(tmp_path / "run", reference)
