"""Client options reach deployed clients: a coordinator and two `fedgrid client` processes with a
non-default model, optimizer, batch size and partition end with `fedgrid simulate`'s model."""

from __future__ import annotations

import pytest
import torch

from fedgrid.config import load_config
from fedgrid.runlog import load_model, read_metrics
from fedgrid.simulation.run import run_simulation

from harness import REFERENCE, start_client, start_coordinator

ROUNDS, CLIENTS, SEED = 2, 2, 3
OPTIONS = {"model": "logistic", "optimizer": "adam", "batch_size": 16, "lr": 0.01, "weight_decay": 0.001}


def _flags(options: dict) -> list[str]:
    return [x for k, v in options.items() for x in ("--" + k.replace("_", "-"), str(v))]


def test_deployed_clients_with_options_match_simulation(tmp_path):
    run_dir = tmp_path / "coord"
    common = ["--rounds", str(ROUNDS), "--seed", str(SEED), "--local-epochs", "1"]
    proc, address = start_coordinator(
        run_dir,
        *common,
        "--min-clients",
        str(CLIENTS),
        "--heartbeat-interval-s",
        "1",
        "--model",
        "logistic",
        "--lr",
        "0.01",
    )
    clients = [
        start_client(
            address,
            tmp_path / f"client{i}.log",
            "--partition",
            f"{i}/{CLIENTS}",
            "--seed",
            str(SEED),
            "--data-partition",
            "shards:2",
            *_flags(OPTIONS),
        )
        for i in range(CLIENTS)
    ]
    try:
        for i, c in enumerate(clients):
            assert c.wait(timeout=180) == 0, (tmp_path / f"client{i}.log").read_text()
        assert proc.wait(timeout=60) == 0
    finally:
        for p in [proc, *clients]:
            if p.poll() is None:
                p.kill()
    metrics = read_metrics(run_dir)
    assert [m["clients_ok"] for m in metrics] == [CLIENTS] * ROUNDS
    deployed = load_model(run_dir / "model.safetensors")
    assert sum(t.numel() for t in deployed.values()) == 650  # logistic 64 -> 10

    config = load_config(
        overrides={
            "rounds": ROUNDS,
            "clients": CLIENTS,
            "seed": SEED,
            "local_epochs": 1,
            "partition": "shards:2",
            "out": str(tmp_path / "sim"),
            **OPTIONS,
            **REFERENCE,
        }
    )
    sim_state, sim_history = run_simulation(config)
    for name, tensor in sim_state.items():
        assert torch.equal(deployed[name], tensor), name  # same engine, same threads: the same bits
    assert metrics[-1]["accuracy"] == pytest.approx(sim_history[-1].accuracy, abs=1e-6)
    # the options mattered: default SGD with momentum ends elsewhere
    default_state, _ = run_simulation(
        load_config(overrides={**config.to_dict(), "optimizer": "sgd", "out": ""})
    )
    assert not torch.allclose(default_state["1.weight"], sim_state["1.weight"], atol=1e-3)
