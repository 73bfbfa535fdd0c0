"""A coordinator with a DP budget, SIGKILLed mid-round and restarted, keeps the epsilon it spent
and stops at the same round as an uninterrupted run (issue 28: the budget lives with the run)."""

from __future__ import annotations

import signal

from fedgrid.config import load_config
from fedgrid.runlog import read_metrics
from fedgrid.simulation.run import run_simulation

from harness import REFERENCE, CoordinatorRun, Relay, start_client, wait_until

CLIENTS, SEED = 2, 5
# sigma 2 at q = 1 (every client every round): epsilon 2.17, 3.19, 4.01, then 4.73 > 4.3.
DP = {"dp_noise_multiplier": 2.0, "dp_clip": "1.0", "dp_epsilon": 4.3}
TASK = {"rounds": 8, "seed": SEED, "local_epochs": 1, "model": "logistic"}


def _flags(options: dict) -> list[str]:
    return [x for k, v in options.items() for x in ("--" + k.replace("_", "-"), str(v))]


def test_a_killed_and_restarted_coordinator_keeps_its_spent_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDGRID_RETRY_MAX_WAIT_S", "0.5")  # the clients find the restart at once
    out, log_path = tmp_path / "run", tmp_path / "coordinator.log"
    common = [
        *_flags({**TASK, **DP}),
        *(
            "--min-clients",
            str(CLIENTS),
            "--heartbeat-interval-s",
            "1",
            "--state-dir",
            str(tmp_path / "state"),
        ),
    ]
    relay = Relay(None)
    runs = [CoordinatorRun(out, common, log_path, trigger=(2, "aggregating"))]
    relay.retarget(int(runs[0].address().rpartition(":")[2]))
    clients = [
        start_client(
            relay.address,
            tmp_path / f"client{i}.log",
            "--partition",
            f"{i}/{CLIENTS}",
            "--seed",
            str(SEED),
            "--model",
            "logistic",
        )
        for i in range(CLIENTS)
    ]
    try:
        wait_until(
            lambda: runs[0].killed.is_set() or runs[0].proc.poll() is not None, timeout=120, what="the kill"
        )
        assert runs[0].proc.wait(timeout=30) == -signal.SIGKILL
        relay.retarget(None)
        runs.append(CoordinatorRun(out, common, log_path))  # a new process, a new random noise key
        relay.retarget(int(runs[1].address().rpartition(":")[2]))
        assert runs[1].proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]
        for i, c in enumerate(clients):
            assert c.wait(timeout=60) == 0, (tmp_path / f"client{i}.log").read_text()[-3000:]
    finally:
        for p in [*(r.proc for r in runs), *clients]:
            if p.poll() is None:
                p.kill()
        relay.close()
    assert runs[1].seen("resumed")[0]["round"] == 1  # round 2 was killed while it aggregated
    stop = runs[1].seen("privacy_budget_reached")
    assert len(stop) == 1 and stop[0]["round"] == 4 and "dp_epsilon 4.3" in stop[0]["reason"]
    metrics = read_metrics(out)
    # The uninterrupted run, in process: the same rounds, the same epsilons, then the same stop.
    _, history = run_simulation(load_config(overrides={**TASK, **DP, "clients": CLIENTS, **REFERENCE}))
    assert [m["round"] for m in metrics] == [m.round for m in history] == [1, 2, 3]
    assert [m["epsilon"] for m in metrics] == [m.extra["epsilon"] for m in history]
