"""SIGTERM mid-round: NOT_SERVING, in-flight work completes or is refused cleanly, exit 0,
and a restart resumes to the same final model."""

from __future__ import annotations

import signal

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedgrid.config import load_config
from fedgrid.runlog import load_model, read_metrics
from fedgrid.simulation.run import run_simulation

from harness import CoordinatorRun, start_client, wait_until

ROUNDS, CLIENTS, SEED = 5, 3, 4


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="fedgrid.v1.Coordinator"), timeout=5)
        return reply.status


@pytest.mark.timeout(300)
def test_sigterm_mid_round_then_resume(tmp_path):
    out, state = tmp_path / "run", tmp_path / "state"
    common = ["--rounds", str(ROUNDS), "--min-clients", str(CLIENTS), "--seed", str(SEED), "--state-dir", str(state),
              "--out", str(out), "--heartbeat-interval-s", "2"]
    first = CoordinatorRun(["--listen", "127.0.0.1:0", *common], tmp_path / "coordinator.log")
    wait_until(lambda: (out / "address").exists(), timeout=60, what="coordinator address")
    address = (out / "address").read_text().strip()
    assert _health(address) == health_pb2.HealthCheckResponse.SERVING
    clients = [start_client(address, tmp_path / f"c{i}.log", "--partition", f"{i}/{CLIENTS}", "--seed", str(SEED)) for i in range(CLIENTS)]
    second = None
    try:
        # Terminate while round 3's uploads arrive.
        wait_until(lambda: any("round 3: accepted update" in line for line in first.lines), timeout=120, what="round 3 uploads")
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=30) == 0
        committed = [m["round"] for m in read_metrics(out)]
        assert committed == list(range(1, len(committed) + 1)) and 2 <= len(committed) <= 3
        assert any("stopped; state up to round" in line for line in first.lines)

        port = address.rpartition(":")[2]
        second = CoordinatorRun(["--listen", f"127.0.0.1:{port}", *common], tmp_path / "coordinator.log")
        assert second.proc.wait(timeout=180) == 0
        for i, c in enumerate(clients):
            assert c.wait(timeout=60) == 0, (tmp_path / f"c{i}.log").read_text()[-2000:]
    finally:
        for p in [first.proc, *([second.proc] if second else []), *clients]:
            if p.poll() is None:
                p.kill()
    assert any(f"resuming after round {len(committed)}" in line for line in second.lines)
    assert [m["round"] for m in read_metrics(out)] == list(range(1, ROUNDS + 1))
    reference, _ = run_simulation(load_config(overrides={"rounds": ROUNDS, "clients": CLIENTS, "seed": SEED, "engine": "sequential"}))
    final = load_model(out / "model.safetensors")
    for name, tensor in reference.items():
        assert torch.equal(final[name], tensor), name
