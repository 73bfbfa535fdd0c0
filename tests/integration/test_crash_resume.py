"""SIGKILL the coordinator at seeded moments; the run still ends bit-identical, each round once."""

from __future__ import annotations

import random
import re
import signal
import sqlite3
import subprocess
import threading

import pytest
import torch

from fedgrid.config import load_config
from fedgrid.runlog import load_model, read_metrics
from fedgrid.simulation.run import run_simulation

from harness import FEDGRID, child_env, start_client, wait_until

ROUNDS, CLIENTS, SEED, KILLS = 10, 3, 11, 5
PHASES = {"upload": "accepted update", "aggregate": "aggregating", "checkpoint": "writing checkpoint"}


class CoordinatorRun:
    """One coordinator incarnation whose log is watched line by line."""

    def __init__(self, args: list[str], log_path) -> None:
        self.lines: list[str] = []
        self.log = open(log_path, "a")
        self.proc = subprocess.Popen([*FEDGRID, "coordinator", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
        self.trigger: tuple[int, str] | None = None
        self.killed = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            self.lines.append(line)
            if self.trigger is not None and not self.killed.is_set():
                server_round, phase = self.trigger
                # The first time the phase happens at or after the chosen round (a redone
                # round may skip a phase: its updates are restored, not uploaded again).
                m = re.search(r"round (\d+): " + PHASES[phase], line)
                if m and int(m.group(1)) >= server_round:
                    self.proc.send_signal(signal.SIGKILL)  # at once, mid-phase
                    self.killed.set()


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
            current.trigger = trigger
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

    config = load_config(overrides={"rounds": ROUNDS, "clients": CLIENTS, "seed": SEED})
    reference, _ = run_simulation(config)
    final = load_model(out / "model.safetensors")
    assert set(final) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(final[name], tensor), name
