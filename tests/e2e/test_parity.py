"""The backbone: a coordinator and three client processes over real gRPC equal `fedgrid simulate`:
bit for bit on the sequential engine with the same thread count, within
``fedgrid.determinism.BATCHED_ATOL`` on the batched engine."""

from __future__ import annotations

import tomllib
import torch

from fedgrid.config import load_config
from fedgrid.determinism import BATCHED_ATOL
from fedgrid.runlog import load_model, read_metrics
from fedgrid.simulation.run import run_simulation

from harness import REFERENCE, REFERENCE_ARGS, REFERENCE_CLIENTS, REFERENCE_ROUNDS, REFERENCE_SEED, THREADS

# The shared reference deployment (tests/conftest.py): a coordinator and three client processes.
ROUNDS, CLIENTS, SEED = REFERENCE_ROUNDS, REFERENCE_CLIENTS, REFERENCE_SEED
KEYS = {"round", "loss", "accuracy", "bytes_up", "bytes_down", "wall_s", "clients_ok", "clients_failed"}


def test_coordinator_and_three_client_processes_match_simulation(tmp_path, reference_deployment):
    run_dir = reference_deployment(REFERENCE_ARGS, clients=CLIENTS, seed=SEED)
    for i in range(CLIENTS):
        text = (run_dir.parent / f"reference.client{i}.log").read_text()
        assert f"{ROUNDS} rounds trained" in text
        assert f"fedgrid client {i}/{CLIENTS}: {THREADS} threads, torch {torch.__version__}" in text
    recorded = tomllib.loads((run_dir / "config.toml").read_text())
    assert recorded["threads"] == THREADS and recorded["environment"]["torch"] == torch.__version__

    metrics = read_metrics(run_dir)
    assert [m["round"] for m in metrics] == list(range(1, ROUNDS + 1))
    for m in metrics:
        assert KEYS <= set(m)
        assert m["clients_ok"] == CLIENTS and m["clients_failed"] == 0
        assert (
            m["bytes_up"] > 3 * 4 * 4810 and m["bytes_down"] > 3 * 4 * 4810
        )  # 3 clients x 4810 float32 params
    assert metrics[-1]["accuracy"] > 0.85
    assert metrics[-1]["accuracy"] > metrics[0]["accuracy"]
    assert (run_dir / "config.toml").exists()

    config = load_config(
        overrides={
            "rounds": ROUNDS,
            "clients": CLIENTS,
            "seed": SEED,
            "out": str(tmp_path / "sim"),
            **REFERENCE,
        }
    )
    sim_state, sim_history = run_simulation(config)
    deployed = load_model(run_dir / "model.safetensors")
    assert set(deployed) == set(sim_state)  # safetensors stores keys sorted
    for name, tensor in sim_state.items():
        assert torch.equal(deployed[name], tensor), name  # sequential engine, same threads: the same bits
    batched, _ = run_simulation(
        load_config(
            overrides={
                "rounds": ROUNDS,
                "clients": CLIENTS,
                "seed": SEED,
                "threads": THREADS,
                "engine": "batched",
            }
        )
    )
    for name, tensor in batched.items():
        torch.testing.assert_close(deployed[name], tensor, atol=BATCHED_ATOL, rtol=0)
    # Bytes are counted the same way in simulation and deployment; deployment's stream
    # headers also carry the run, task, client id and session token (under 200 bytes each).
    for sim_m, m in zip(sim_history, metrics):
        assert 0 <= m["bytes_up"] - sim_m.bytes_up <= 200 * CLIENTS
        assert 0 <= m["bytes_down"] - sim_m.bytes_down <= 200 * CLIENTS
    sim_model = load_model(tmp_path / "sim" / "model.safetensors")
    for name in sim_state:
        assert torch.equal(sim_model[name], sim_state[name])
