"""SIGKILL the coordinator at seeded moments; the run still ends bit-identical, each round once."""

from __future__ import annotations

import random
import signal
import sqlite3

import pytest
import torch

from fedgrid.config import load_config
from fedgrid.runlog import load_model, read_metrics
from fedgrid.simulation.run import run_simulation

from harness import CoordinatorRun, start_client, wait_until

ROUNDS, CLIENTS, SEED, KILLS = 10, 3, 11, 5
PHASES = {"upload": "accepted update", "aggregate": "aggregating", "checkpoint": "writing checkpoint"}


@pytest.mark.timeout(420)
def test_sigkill_at_random_moments_changes_nothing(tmp_path):
    rng = random.Random(SEED)
    # One kill in each phase, the rest anywhere; rounds drawn from the seed, in run order.
    phases = list(PHASES) + rng.choices(list(PHASES), k=KILLS - len(PHASES))
    schedule = sorted(zip(sorted(rng.sample(range(1, ROUNDS), KILLS)), phases))
    out, state = tmp_path / "run", tmp_path / "state"
    common = ["--rounds", str(ROUNDS), "--min-clients", str(CLIENTS), "--seed", str(SEED), "--state-dir", str(state),
              "--out", str(out), "--heartbeat-interval-s", "2"]
    log_path = tmp_path / "coordinator.log"

    first = CoordinatorRun(["--listen", "127.0.0.1:0", *common], log_path)
    wait_until(lambda: (out / "address").exists(), timeout=60, what="coordinator address")
    address = (out / "address").read_text().strip()
    port = address.rpartition(":")[2]  # restarts reuse the port the first start was given
    clients = [
        start_client(address, tmp_path / f"client{i}.log", "--partition", f"{i}/{CLIENTS}", "--seed", str(SEED))
        for i in range(CLIENTS)
    ]
    pids = [c.pid for c in clients]
    runs = [first]
    try:
        current = first
        for trigger in schedule:
            current.trigger = (trigger[0], PHASES[trigger[1]])
            wait_until(lambda: current.killed.is_set() or current.proc.poll() is not None, timeout=120, what=f"kill at {trigger}")
            assert current.killed.is_set(), f"run ended before the kill at {trigger}"
            assert current.proc.wait(timeout=30) == -signal.SIGKILL
            current = CoordinatorRun(["--listen", f"127.0.0.1:{port}", *common], log_path)
            runs.append(current)
        assert current.proc.wait(timeout=240) == 0, log_path.read_text()[-3000:]
        for i, c in enumerate(clients):
            assert c.wait(timeout=60) == 0, (tmp_path / f"client{i}.log").read_text()[-3000:]
    finally:
        for p in [*(r.proc for r in runs), *clients]:
            if p.poll() is None:
                p.kill()
    assert [c.pid for c in clients] == pids and len(runs) == KILLS + 1  # no client restarted; 5 kills
    assert sum("resuming after round" in line for r in runs for line in r.lines) >= KILLS - 1

    assert [m["round"] for m in read_metrics(out)] == list(range(1, ROUNDS + 1))
    with sqlite3.connect(state / "history.sqlite") as db:
        assert [r[0] for r in db.execute("SELECT round FROM rounds ORDER BY round")] == list(range(1, ROUNDS + 1))

    config = load_config(overrides={"rounds": ROUNDS, "clients": CLIENTS, "seed": SEED, "engine": "sequential"})  # the deployed clients' own code: bit for bit
    reference, _ = run_simulation(config)
    final = load_model(out / "model.safetensors")
    assert set(final) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(final[name], tensor), name
