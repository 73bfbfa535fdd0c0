"""SIGTERM mid-round: NOT_SERVING, in-flight work completes or is refused cleanly, exit 143 (128 + SIGTERM),
and a restart resumes to the same final model as an uninterrupted deployment."""

from __future__ import annotations

import re
import signal
import time

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedgrid.runlog import load_model, read_metrics

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

# The shared reference deployment's run (tests/conftest.py), stopped in round 3 and resumed.
ROUNDS, CLIENTS, SEED = REFERENCE_ROUNDS, REFERENCE_CLIENTS, REFERENCE_SEED


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="fedgrid.v1.Coordinator"), timeout=5
        )
        return reply.status


def test_sigterm_mid_round_then_resume(tmp_path, reference_deployment):
    common = list(REFERENCE_ARGS)
    reference = reference_deployment(common, clients=CLIENTS, seed=SEED)

    out, log_path = tmp_path / "run", tmp_path / "coordinator.log"
    common += ["--state-dir", str(tmp_path / "state")]
    # Terminate while round 3's uploads arrive.
    first = CoordinatorRun(out, common, log_path, trigger=(3, "update_accepted"), sig=signal.SIGTERM)
    address = first.address()
    assert _health(address) == health_pb2.HealthCheckResponse.SERVING
    relay = Relay(int(address.rpartition(":")[2]))
    clients = [
        start_client(
            relay.address, tmp_path / f"c{i}.log", "--partition", f"{i}/{CLIENTS}", "--seed", str(SEED)
        )
        for i in range(CLIENTS)
    ]
    second = None
    try:
        wait_until(
            lambda: first.killed.is_set() or first.proc.poll() is not None,
            timeout=120,
            what="round 3 uploads",
        )
        signalled = time.monotonic()  # the process signalled itself just before printing the event
        assert first.killed.is_set(), "the run ended before round 3's uploads"
        # Within 5 s of the signal, with uploads in flight (issue 40, item 3).
        wait_until(lambda: first.proc.poll() is not None, timeout=5.0, what="the coordinator's exit")
        print(
            f"stop during uploads: the coordinator exited {time.monotonic() - signalled:.2f} s after SIGTERM"
        )
        assert first.proc.returncode == 128 + signal.SIGTERM  # stopped cleanly, yet not finished
        committed = [m["round"] for m in read_metrics(out)]
        assert committed == list(range(1, len(committed) + 1)) and 2 <= len(committed) <= 3
        assert [e["committed"] for e in first.seen("stopped")] == [len(committed)]
        # Round 3 closed by the stop, or had closed (all uploads in) just before the signal was
        # heard and was then committed or abandoned whole: never committed by half.
        assert [e["round"] for e in first.seen("round_committed")] == committed
        assert first.seen("round_closed", round=3, reason="stopping") or first.seen(
            "round_closed", round=3, reason="all"
        )
        # the model of the last committed round is in --out, as after a finished run
        stopped_model = load_model(out / "model.safetensors")
        assert stopped_model and all(torch.isfinite(t).all() for t in stopped_model.values())

        relay.retarget(None)
        second = CoordinatorRun(out, common, log_path)
        relay.retarget(int(second.address().rpartition(":")[2]))
        assert second.proc.wait(timeout=180) == 0
        for i, c in enumerate(clients):
            assert c.wait(timeout=60) == 0, (tmp_path / f"c{i}.log").read_text()[-2000:]
    finally:
        for p in [first.proc, *([second.proc] if second else []), *clients]:
            if p.poll() is None:
                p.kill()
        relay.close()
    assert [e["round"] for e in second.seen("resumed")] == [len(committed)]
    # the restart prints (and its clients hear) the restored run id, not a fresh one
    run_id = first.seen("started")[0]["run_id"]
    assert [e["run_id"] for e in second.seen("started")] == [run_id]
    assert [m["round"] for m in read_metrics(out)] == list(range(1, ROUNDS + 1))
    assert_same_model(out, reference)
    # each client says what it did each round, in one line
    trained = re.findall(
        r"INFO fedgrid\.client\.runtime: round (\d+): trained on (\d+) examples in \d+\.\d s: "
        r"compute \d+\.\d s, comm \d+\.\d s, wait \d+\.\d s \(utilization [01]\.\d\d\), loss (\d+\.\d{4})$",
        (tmp_path / "c0.log").read_text(),
        flags=re.M,
    )
    assert {int(r) for r, _, _ in trained} >= {1, 2, ROUNDS} and all(int(n) > 0 for _, n, _ in trained)
