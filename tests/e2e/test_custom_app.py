"""A user's own model and client (--model, --app) with federated evaluation, deployed and simulated."""

from __future__ import annotations

from pathlib import Path

import torch

from fedgrid.config import load_config
from fedgrid.runlog import load_model, read_metrics
from fedgrid.simulation.run import run_simulation

from harness import REFERENCE, start_client, start_coordinator

COMMON = [
    "--rounds",
    "3",
    "--seed",
    "5",
    "--lr",
    "0.05",
    "--fraction-evaluate",
    "1",
    "--model",
    "linear_app:model",
]


def test_custom_app_with_federated_evaluation_matches_simulation(tmp_path, monkeypatch):
    run_dir = tmp_path / "coord"
    # -X importtime lists every module the coordinator imports: a user model needs no dataset code.
    proc, address = start_coordinator(
        run_dir,
        *COMMON,
        "--min-clients",
        "2",
        "--heartbeat-interval-s",
        "1",
        env={"PYTHONPROFILEIMPORTTIME": "1"},
    )
    clients = [
        start_client(
            address, tmp_path / "c0.log", "--app", "linear_app:client", "--partition", "0/2", "--seed", "5"
        ),
        start_client(
            address,
            tmp_path / "c1.log",
            "--app",
            "linear_app:client_without_eval",
            "--partition",
            "1/2",
            "--seed",
            "5",
        ),
    ]
    try:
        for i, c in enumerate(clients):
            assert c.wait(timeout=180) == 0, (tmp_path / f"c{i}.log").read_text()
        assert proc.wait(timeout=60) == 0
    finally:
        for p in [proc, *clients]:
            if p.poll() is None:
                p.kill()
    imported = [
        line.rsplit("|", 1)[-1].strip()
        for line in (tmp_path / "coord.coordinator.log").read_text().splitlines()
        if line.startswith("import time:")
    ]
    assert "fedgrid.server.serve" in imported and "fedgrid.server.remote_fleet" in imported
    assert not [m for m in imported if m.startswith(("fedgrid.simulation", "sklearn"))]
    metrics = read_metrics(run_dir)
    assert [m["round"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["clients_ok"] == 2 and m["clients_failed"] == 0
        assert (
            m["clients_evaluated"] == 1
        )  # the client without evaluation data is a failure of the evaluation only
        assert m["accuracy"] is None  # regression: no accuracy is made up
        assert m["loss"] == m["federated_loss"]
    assert metrics[-1]["loss"] < metrics[0]["loss"] < 5.0

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "support" / "apps"))
    overrides = {"rounds": 3, "seed": 5, "lr": 0.05, "clients": 2, "out": str(tmp_path / "sim"), **REFERENCE}
    config = load_config(overrides={**overrides, "model": "linear_app:model", "app": "linear_app:client"})
    sim_state, _ = run_simulation(config)
    deployed = load_model(run_dir / "model.safetensors")
    for name, tensor in sim_state.items():
        assert torch.equal(deployed[name], tensor), name  # same engine, same threads: the same bits
    # Training recovered the true weights, so the federation did learn.
    torch.testing.assert_close(deployed["weight"], torch.tensor([[2.0, -3.0, 0.5]]), atol=0.3, rtol=0)
