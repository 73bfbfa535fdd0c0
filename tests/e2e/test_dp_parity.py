"""A deployment with differential privacy and `fedgrid simulate` given its noise key end with the
same bits and the same epsilons (issue 28: simulation stays bit-identical to deployment)."""

from __future__ import annotations

import torch

from fedgrid.config import load_config
from fedgrid.runlog import load_model, read_metrics
from fedgrid.simulation.run import run_simulation

from harness import REFERENCE, start_client, start_coordinator

ROUNDS, CLIENTS, SEED = 2, 2, 5
DP = {"dp_noise_multiplier": 0.8, "dp_clip": "adaptive:0.5", "dp_epsilon": 50.0}


def _flags(options: dict) -> list[str]:
    return [x for k, v in options.items() for x in ("--" + k.replace("_", "-"), str(v))]


def test_a_private_deployment_equals_its_simulation_given_the_noise_key(tmp_path):
    key = tmp_path / "noise.key"
    key.write_bytes(bytes(range(100, 132)))
    run_dir = tmp_path / "coord"
    common = ["--rounds", str(ROUNDS), "--seed", str(SEED), "--local-epochs", "1", "--model", "logistic"]
    proc, address = start_coordinator(
        run_dir, *common, "--min-clients", str(CLIENTS), *_flags(DP), "--dp-noise-key", str(key)
    )
    clients = [
        start_client(
            address,
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

    overrides = {"rounds": ROUNDS, "clients": CLIENTS, "seed": SEED, "local_epochs": 1, "model": "logistic"}
    config = load_config(overrides={**overrides, **DP, "dp_noise_key": str(key), **REFERENCE})
    sim_state, sim_history = run_simulation(config)
    for name, tensor in sim_state.items():
        assert torch.equal(deployed[name], tensor), name  # the same noise, drawn from the same key
    assert [m["epsilon"] for m in metrics] == [m.extra["epsilon"] for m in sim_history]
    assert [m["dp_clip"] for m in metrics] == [m.extra["dp_clip"] for m in sim_history]
    # Without the key a simulation derives its own from the seed: other noise, other bits.
    other, _ = run_simulation(load_config(overrides={**overrides, **DP, **REFERENCE}))
    assert any(not torch.equal(other[name], sim_state[name]) for name in sim_state)
