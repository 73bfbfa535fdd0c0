"""A strategy of your own deploys unchanged: ``fedgrid coordinator --strategy
examples.custom_strategy:ServerLRAvg`` with three client processes ends on the model of
``fedgrid simulate`` with the same strategy, bit for bit."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fedgrid.config import load_config
from fedgrid.runlog import load_model, read_metrics
from fedgrid.simulation.run import run_simulation

from harness import REFERENCE, child_env, start_client, start_coordinator

ROOT = Path(__file__).resolve().parents[2]
SPEC = "examples.custom_strategy:ServerLRAvg"
ROUNDS, CLIENTS, SEED = 3, 3, 7
# fraction_fit 0.7 of 3 clients: ServerLRAvg asks round(2.1) = 2 a round, where FedAvg would ask 2.1 -> 3.
KEYS = {"rounds": ROUNDS, "seed": SEED, "fraction_fit": 0.7, "server_lr": 0.5}


def test_custom_strategy_deployed_matches_its_simulation(tmp_path, monkeypatch):
    run_dir = tmp_path / "coord"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in KEYS.items()]
    path = os.pathsep.join([str(ROOT), child_env()["PYTHONPATH"]])  # `examples` from the repository root
    proc, address = start_coordinator(
        run_dir,
        "--strategy",
        SPEC,
        *flags,
        "--min-clients",
        str(CLIENTS),
        "--heartbeat-interval-s",
        "1",
        env={"PYTHONPATH": path},
    )
    clients = [
        start_client(
            address, tmp_path / f"client{i}.log", "--partition", f"{i}/{CLIENTS}", "--seed", str(SEED)
        )
        for i in range(CLIENTS)
    ]
    try:
        for i, c in enumerate(clients):
            assert c.wait(timeout=180) == 0, (tmp_path / f"client{i}.log").read_text()[-2000:]
        assert proc.wait(timeout=60) == 0, (tmp_path / "coord.coordinator.log").read_text()[-2000:]
    finally:
        for p in [proc, *clients]:
            if p.poll() is None:
                p.kill()
    metrics = read_metrics(run_dir)
    assert [(m["round"], m["clients_ok"], m["clients_failed"]) for m in metrics] == [
        (r, 2, 0) for r in range(1, ROUNDS + 1)
    ]
    assert all("failed_total" in m for m in metrics)  # ServerLRAvg's own aggregate metrics
    assert load_config(run_dir / "config.toml").strategy == SPEC

    monkeypatch.syspath_prepend(str(ROOT))
    config = load_config(overrides={"strategy": SPEC, "clients": CLIENTS, **KEYS, **REFERENCE})
    sim_state, sim_history = run_simulation(config)
    deployed = load_model(run_dir / "model.safetensors")
    assert set(deployed) == set(sim_state)
    for name, tensor in sim_state.items():
        assert torch.equal(deployed[name], tensor), name  # same engine, same threads: the same bits
    assert [m.clients_ok for m in sim_history] == [2] * ROUNDS
    assert metrics[-1]["accuracy"] == sim_history[-1].accuracy
