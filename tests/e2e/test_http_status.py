"""``--http`` on a real run: a coordinator and two clients over gRPC on loopback, in process.

``/metrics`` and ``/api/status`` are read from inside the coordinator's own event stream (a
subscriber runs on the emitting thread, so the run waits while it reads): during round 2,
right after an update was accepted, and at ``finished``, when ``metrics.jsonl`` holds every
round and the server still listens. The counters must equal what ``metrics.jsonl`` says.
"""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedgrid.cli import main, serve
from fedgrid.client import start_client
from fedgrid.client.monitor import ClientMonitor, serve_client_metrics
from fedgrid.config import load_config
from fedgrid.events import Event
from fedgrid.simulation.tasks import builtin_client

import zygote
from harness import THREADS, wait_until

ROUNDS = 3


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        return reply.read()


def _metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_and_status_follow_a_real_run(tmp_path, capsys):
    out = tmp_path / "run"
    config = load_config(
        overrides={
            "listen": "127.0.0.1:0",
            "http": "127.0.0.1:0",
            "out": str(out),
            "rounds": ROUNDS,
            "min_clients": 2,
            "threads": THREADS,
            "local_epochs": 1,
            "seed": 0,
        }
    )
    seen: dict[str, object] = {}
    errors: list[BaseException] = []

    def on_event(e: Event) -> None:
        base = f"http://{(out / 'http_address').read_text().strip()}"
        try:
            if e.event == "update_accepted" and e["round"] == 2 and "during" not in seen:
                seen["during"] = (
                    e.fields,
                    json.loads(_get(base + "/api/status")),
                    _metrics(_get(base + "/metrics").decode()),
                )
            elif e.event == "finished":
                seen["metrics"] = _get(base + "/metrics").decode()
                seen["status"] = json.loads(_get(base + "/api/status"))
                seen["cli"] = main(["status", base.removeprefix("http://")])
        except BaseException as exc:  # noqa: BLE001 - reported by the test below, not swallowed by the event log
            errors.append(exc)

    coordinator = threading.Thread(
        target=lambda: seen.setdefault("final", serve(config, on_event=on_event)), daemon=True
    )
    coordinator.start()
    wait_until(lambda: (out / "address").exists(), timeout=60, what="the coordinator's address")
    address = (out / "address").read_text().strip()
    monitors = [ClientMonitor(), None]
    monitors[1], client_http = serve_client_metrics("127.0.0.1:0")
    clients = [builtin_client(i, 2, 0) for i in range(2)]
    handles = [start_client(c, address, on_task=m.on_task) for c, m in zip(clients, monitors)]
    try:
        summaries = [h.join(timeout=180) for h in handles]
        coordinator.join(timeout=60)
        assert not coordinator.is_alive()
        assert not errors, errors
        assert [s.rounds for s in summaries] == [ROUNDS, ROUNDS]
        client_metrics = _metrics(_get(f"http://{client_http.address}/metrics").decode())
    finally:
        client_http.stop()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))

    # During round 2: the phase, its progress and the reporting client's state.
    fields, during, mid = seen["during"]
    assert (during["state"], during["round"], during["rounds"], during["phase"]) == (
        "running",
        2,
        ROUNDS,
        "fit",
    )
    assert during["committed"] == 1 and len(during["history"]) == 1
    progress = during["progress"]
    assert (progress["round"], progress["phase"], progress["expected"]) == (2, "fit", 2)
    assert fields["accepted"] <= progress["results"] <= 2
    by_id = {c["id"]: c for c in during["clients"]}
    assert len(by_id) == 2 and by_id[fields["client"]]["state"] == "reported"
    assert sorted(c["name"] for c in during["clients"]) == sorted(c.name for c in clients)
    assert all(0 <= c["last_seen_s"] < 60 for c in during["clients"])
    assert mid[("fedgrid_live_clients", ())] == 2
    assert mid[("fedgrid_round", ())] == 2

    # At the end: every counter equals metrics.jsonl.
    got = _metrics(seen["metrics"])
    assert got[("fedgrid_rounds_committed_total", ())] == len(rows)
    assert got[("fedgrid_rounds_failed_total", ())] == 0
    assert got[("fedgrid_bytes_total", (("direction", "up"),))] == sum(r["bytes_up"] for r in rows)
    assert got[("fedgrid_bytes_total", (("direction", "down"),))] == sum(r["bytes_down"] for r in rows)
    assert (
        got[("fedgrid_client_results_total", (("outcome", "ok"),))]
        == sum(r["clients_ok"] for r in rows)
        == 2 * ROUNDS
    )
    assert (
        got[("fedgrid_client_results_total", (("outcome", "failed"),))]
        == sum(r["clients_failed"] for r in rows)
        == 0
    )
    assert got[("fedgrid_updates_accepted_total", (("phase", "fit"),))] == 2 * ROUNDS
    assert got[("fedgrid_round_duration_seconds_count", ())] == len(rows)
    assert got[("fedgrid_round_duration_seconds_sum", ())] == pytest.approx(
        sum(r["wall_s"] for r in rows), abs=1e-3
    )
    assert got[("fedgrid_phase_duration_seconds_count", (("phase", "fit"),))] == ROUNDS
    assert got[("fedgrid_phase_duration_seconds_count", (("phase", "aggregate"),))] == ROUNDS
    assert got[("fedgrid_clients_joined_total", ())] == 2
    assert got[("fedgrid_rpc_duration_seconds_count", (("code", "OK"), ("method", "Join")))] == 2
    assert (
        got[("fedgrid_rpc_duration_seconds_count", (("code", "OK"), ("method", "UploadUpdate")))]
        == 2 * ROUNDS
    )
    assert (
        got[("fedgrid_rpc_duration_seconds_count", (("code", "OK"), ("method", "DownloadModel")))]
        == 2 * ROUNDS
    )

    status = seen["status"]
    assert (status["state"], status["committed"], status["round"]) == ("finished", ROUNDS, ROUNDS)
    assert [
        (h["round"], h["accuracy"], h["loss"], h["bytes_up"], h["bytes_down"]) for h in status["history"]
    ] == [(r["round"], r["accuracy"], r["loss"], r["bytes_up"], r["bytes_down"]) for r in rows]
    assert all(0.0 < h["accuracy"] <= 1.0 for h in status["history"])

    # The clients' own counters add up to the coordinator's.
    local = _metrics(_generate(monitors[0]))
    both = [local, client_metrics]
    assert [m[("fedgrid_client_rounds_trained_total", ())] for m in both] == [ROUNDS, ROUNDS]
    assert [m[("fedgrid_client_examples_total", (("kind", "fit"),))] for m in both] == [
        ROUNDS * c.num_examples for c in clients
    ]
    assert sum(m[("fedgrid_client_bytes_total", (("direction", "up"),))] for m in both) == sum(
        r["bytes_up"] for r in rows
    )
    assert sum(m[("fedgrid_client_bytes_total", (("direction", "down"),))] for m in both) == sum(
        r["bytes_down"] for r in rows
    )
    assert all(m[("fedgrid_client_upload_retries_total", ())] == 0 for m in both)
    assert all(m[("fedgrid_client_last_round", ())] == ROUNDS for m in both)
    assert all(0.0 < m[("fedgrid_client_last_loss", ())] < 10.0 for m in both)

    # `fedgrid status` drew the same run.
    assert seen["cli"] == 0
    printed = capsys.readouterr().out
    assert f"{ROUNDS} / {ROUNDS}" in printed and "finished" in printed
    assert all(c.name in printed for c in clients)


def _generate(monitor: ClientMonitor) -> str:
    from prometheus_client import generate_latest

    return generate_latest(monitor.registry).decode()


def test_status_command_names_the_address_it_cannot_reach(capsys):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["status", f"127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fedgrid status: cannot connect to 127.0.0.1:{port} ")


def test_coordinator_http_off_loopback_without_token_fails_before_listening(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(
            [
                "coordinator",
                "--listen",
                "127.0.0.1:0",
                "--http",
                "0.0.0.0:0",
                "--out",
                str(out),
                "--rounds",
                "1",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "fedgrid: error: config key 'http': '0.0.0.0' is not a loopback address" in err
        and "http_token_file" in err
    )
    assert not (out / "address").exists() and not (out / "http_address").exists()


def test_rpc_latencies_carry_the_status_code_of_refused_calls(small_state):
    import grpc

    from fedgrid.proto import fedgrid_pb2 as pb
    from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc
    from fedgrid.proto.tls import session_metadata
    from fedgrid.server.monitor import CoordinatorMonitor
    from fedgrid.server.remote_fleet import RemoteFleet

    from harness import InProcessCoordinator

    probe = RemoteFleet()  # the monitor's histogram, timing another coordinator's calls
    monitor = CoordinatorMonitor(probe, rounds=1, history=list)
    c = InProcessCoordinator(small_state, interceptors=(monitor.interceptor(),))
    try:
        with grpc.insecure_channel(c.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            joined = stub.Join(pb.JoinRequest(name="probe", num_examples=3), timeout=10)
            for _ in range(2):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Heartbeat(
                        pb.HeartbeatRequest(client_id=joined.client_id),
                        metadata=session_metadata("wrong"),
                        timeout=10,
                    )
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stub.Heartbeat(
                pb.HeartbeatRequest(client_id=joined.client_id),
                metadata=session_metadata(joined.session_token),
                timeout=10,
            )
    finally:
        c.stop()
        probe.close()
    got = _metrics(monitor.metrics_text().decode())
    assert got[("fedgrid_rpc_duration_seconds_count", (("code", "OK"), ("method", "Join")))] == 1
    assert (
        got[("fedgrid_rpc_duration_seconds_count", (("code", "UNAUTHENTICATED"), ("method", "Heartbeat")))]
        == 2
    )
    assert got[("fedgrid_rpc_duration_seconds_count", (("code", "OK"), ("method", "Heartbeat")))] == 1


def test_processes_serve_http_from_their_flags(tmp_path):
    """``fedgrid coordinator --http`` and ``fedgrid client --http`` as processes: the coordinator
    waits for a second client, so both stay up while they are read."""
    import re
    import sys

    from harness import child_env, start_client, start_coordinator

    out = tmp_path / "run"
    coordinator, address = start_coordinator(
        out, "--http", "127.0.0.1:0", "--min-clients", "2", "--rounds", "1"
    )
    client = start_client(address, tmp_path / "client.log", "--http", "127.0.0.1:0", "--partition", "0/2")
    try:
        base = f"http://{(out / 'http_address').read_text().strip()}"
        wait_until(
            lambda: json.loads(_get(base + "/api/status"))["clients_total"] == 1,
            timeout=60,
            what="the client's join",
        )
        status = json.loads(_get(base + "/api/status"))
        assert (status["state"], status["phase"], status["committed"], status["rounds"]) == (
            "running",
            "waiting",
            0,
            1,
        )
        assert [(c["name"], c["state"]) for c in status["clients"]] == [("digits-0000/2", "idle")]
        wait_until(
            lambda: "metrics on http://" in (tmp_path / "client.log").read_text(),
            timeout=60,
            what="the client's metrics address",
        )
        client_url = re.search(
            r"metrics on (http://\S+/metrics)", (tmp_path / "client.log").read_text()
        ).group(1)
        got = _metrics(_get(client_url).decode())
        assert got[("fedgrid_client_rounds_trained_total", ())] == 0
        assert got[("fedgrid_client_bytes_total", (("direction", "up"),))] == 0
        assert _metrics(_get(base + "/metrics").decode())[("fedgrid_live_clients", ())] == 1
        shown = zygote.run(
            [sys.executable, "-m", "fedgrid.cli", "status", base.removeprefix("http://")],
            capture_output=True,
            text=True,
            timeout=60,
            env=child_env(),
        )
        assert shown.returncode == 0, shown.stderr
        assert "0 / 1" in shown.stdout and "digits-0000/2" in shown.stdout and "idle" in shown.stdout
    finally:
        for proc in (client, coordinator):
            proc.kill()
            proc.wait(timeout=30)
