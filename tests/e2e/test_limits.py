"""Limits that keep the coordinator responsive under broken or hostile clients: long polls
per client, transfers in flight, idle upload streams; idle streams hold no thread."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedgrid.client.runtime import Connection
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import serde
from fedgrid.proto.tls import session_metadata
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator

from harness import wait_until
from harness_clients import Named

UPLOAD = "/fedgrid.v1.Coordinator/UploadUpdate"


class IdleStreams:
    """``n`` UploadUpdate streams that send nothing (or only ``first``), held open from an
    asyncio loop in a thread of this process until ``close``."""

    def __init__(self, address: str, n: int, first: bytes | None = None, metadata=None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.codes: list[grpc.StatusCode] = []
        self.details: list[str] = []

        async def open_all() -> None:
            self.never = asyncio.Event()
            self.channel = grpc.aio.insecure_channel(address)
            method = self.channel.stream_unary(UPLOAD, request_serializer=None, response_deserializer=None)

            async def frames():
                if first is not None:
                    yield first
                await self.never.wait()

            async def one() -> None:
                try:
                    await method(frames(), metadata=metadata)
                except grpc.aio.AioRpcError as exc:
                    self.codes.append(exc.code())
                    self.details.append(exc.details() or "")

            self.tasks = [asyncio.ensure_future(one()) for _ in range(n)]

        asyncio.run_coroutine_threadsafe(open_all(), self.loop).result(30)

    def close(self) -> None:
        async def stop() -> None:
            for t in self.tasks:
                t.cancel()
            await self.channel.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _server(**kwargs) -> tuple[RemoteFleet, Coordinator]:
    fleet = RemoteFleet(
        heartbeat_interval=timedelta(seconds=60), max_polls_per_client=kwargs.pop("max_polls_per_client", 2)
    )
    return fleet, Coordinator("127.0.0.1:0", fleet, max_workers=4, **kwargs).start()


def test_a_client_holds_at_most_its_poll_limit(small_state):
    fleet, server = _server(max_polls_per_client=2)
    conn = Connection(server.address)
    try:
        conn.join(Named("poller"))
        request = pb.PollRequest(client_id=conn.client_id, wait_s=20)
        md = session_metadata(conn.token)
        held = [conn.stub.PollTask.future(request, metadata=md, timeout=30) for _ in range(2)]
        wait_until(lambda: fleet.polls_held(conn.client_id) == 2, timeout=10, what="two polls held")
        with pytest.raises(grpc.RpcError) as err:
            conn.stub.PollTask(request, metadata=md, timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "already holds 2 long polls (limit 2)" in err.value.details()
        assert not any(f.done() for f in held)  # the held polls are untouched
        for f in held:
            f.cancel()
        wait_until(lambda: fleet.polls_held(conn.client_id) == 0, timeout=10, what="polls released")
        assert (
            conn.stub.PollTask(
                pb.PollRequest(client_id=conn.client_id, wait_s=0), metadata=md, timeout=10
            ).retry_after_s
            == 0.0
        )
    finally:
        conn.close()
        server.stop(grace=0.5)
        fleet.close()


def _open_round(fleet: RemoteFleet, small_state, conns: list[Connection]):
    """A fit round over the joined ``conns`` in a thread; returns it and each one's task."""
    from fedgrid.types import FitIns

    infos = fleet.wait_for_clients(min_clients=len(conns), timeout=timedelta(seconds=10))
    rnd = threading.Thread(
        target=fleet.fit_round,
        kwargs=dict(
            server_round=1,
            global_state=small_state,
            assignments=[(info, FitIns(round=1)) for info in infos],
            timeout=timedelta(seconds=60),
        ),
    )
    rnd.start()
    return rnd, [conn.poll(10).task for conn in conns]


def _header(fleet: RemoteFleet, small_state, conn: Connection, task) -> bytes:
    """The first frame of ``conn``'s upload for ``task``: its header."""
    info = serde.StreamInfo(
        run_id=fleet.run_id, task_id=task.task_id, round=task.round, client_id=conn.client_id, num_examples=3
    )
    return next(iter(serde.EncodedModel(small_state).frames(info, chunk_size=16)))


def test_transfers_beyond_the_limit_are_refused_and_join_stays_fast(small_state):
    fleet, server = _server(max_transfers=3)
    conns = [Connection(server.address) for _ in range(4)]
    streams: list[IdleStreams] = []
    try:
        for i, conn in enumerate(conns):
            conn.join(Named(f"uploader-{i}"))
        rnd, tasks = _open_round(fleet, small_state, conns)
        # Three uploads send their header, then stall: each holds a slot.
        for conn, task in list(zip(conns, tasks))[:3]:
            md = session_metadata(conn.token)
            streams.append(
                IdleStreams(server.address, 1, first=_header(fleet, small_state, conn, task), metadata=md)
            )
        wait_until(lambda: server_transfers(server) == 3, timeout=20, what="three uploads holding slots")
        extra = IdleStreams(
            server.address,
            1,
            first=_header(fleet, small_state, conns[3], tasks[3]),
            metadata=session_metadata(conns[3].token),
        )
        streams.append(extra)
        wait_until(lambda: extra.codes != [], timeout=20, what="the fourth upload refused")
        assert (
            extra.codes == [grpc.StatusCode.RESOURCE_EXHAUSTED]
            and "3 transfers in flight (limit 3)" in extra.details[0]
        )
        conn = Connection(server.address)
        start = time.monotonic()
        conn.join(Named("newcomer"))
        with grpc.insecure_channel(server.address) as channel:
            status = (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                .status
            )
        assert status == health_pb2.HealthCheckResponse.SERVING and conn.client_id
        assert time.monotonic() - start < 5.0  # a generous bound: served at once, not after a time-out
        conn.close()
        fleet.interrupt()
        rnd.join(10)
    finally:
        for stream in streams:
            stream.close()
        for c in conns:
            c.close()
        server.stop(grace=0.5)
        fleet.close()


def server_transfers(server: Coordinator) -> int:
    servicer = server.servicer
    return servicer.transfers


def test_idle_upload_streams_are_given_up(small_state):
    from fedgrid.types import FitIns

    fleet, server = _server(stream_idle_s=0.5, header_timeout_s=0.5)
    conn = Connection(server.address)
    try:
        conn.join(Named("stalls"))
        infos = fleet.wait_for_clients(min_clients=1, timeout=timedelta(seconds=10))
        outcome = []
        rnd = threading.Thread(
            target=lambda: outcome.append(
                fleet.fit_round(
                    server_round=1,
                    global_state=small_state,
                    assignments=[(infos[0], FitIns(round=1))],
                    timeout=timedelta(seconds=30),
                )
            )
        )
        rnd.start()
        task = conn.poll(10).task
        # In the session, but not even a header; a stream without a session is refused at once.
        silent = IdleStreams(server.address, 1, metadata=session_metadata(conn.token))
        anonymous = IdleStreams(server.address, 1)
        info = serde.StreamInfo(
            run_id=fleet.run_id, task_id=task.task_id, round=1, client_id=conn.client_id, num_examples=3
        )
        first = next(iter(serde.EncodedModel(small_state).frames(info, chunk_size=16)))
        stalled = IdleStreams(
            server.address, 1, first=first, metadata=session_metadata(conn.token)
        )  # a header and a first chunk, then nothing
        wait_until(lambda: silent.codes and stalled.codes, timeout=20, what="both streams given up")
        assert (
            anonymous.codes == [grpc.StatusCode.UNAUTHENTICATED]
            and "no session token" in anonymous.details[0]
        )
        assert (
            silent.codes == [grpc.StatusCode.DEADLINE_EXCEEDED]
            and "sent no header within 0.5s" in silent.details[0]
        )
        assert (
            stalled.codes == [grpc.StatusCode.DEADLINE_EXCEEDED]
            and "upload stream idle for 0.5s" in stalled.details[0]
        )
        wait_until(lambda: server_transfers(server) == 0, timeout=10, what="transfers released")
        # What arrived is kept for the client to resume from, and the round still waits for it.
        assert (
            conn.stub.UploadStatus(
                pb.UploadStatusRequest(client_id=conn.client_id, task_id=task.task_id),
                metadata=session_metadata(conn.token),
                timeout=10,
            ).chunks_received
            == 1
        )
        assert fleet.current_round is not None and fleet.current_round.results == {}
        silent.close()
        stalled.close()
        anonymous.close()
        fleet.interrupt()
        rnd.join(10)
    finally:
        conn.close()
        server.stop(grace=0.5)
        fleet.close()


def test_many_clients_in_one_process_each_have_their_own_connection(tmp_path):
    """With 4 streams allowed per connection, six SDK clients in this process (a long poll
    and a heartbeat each) still all train: channels to one target do not share a connection."""
    from fedgrid.client import start_client
    from fedgrid.events import read_events
    from fedgrid.runlog import read_metrics

    from harness import start_coordinator

    proc, address = start_coordinator(
        tmp_path / "coord",
        "--rounds",
        "2",
        "--min-clients",
        "6",
        "--heartbeat-interval-s",
        "1",
        env={"FEDGRID_MAX_STREAMS_PER_CONNECTION": "4"},
    )
    handles = [start_client(Named(f"embedded-{i}"), address, poll_wait_s=5.0) for i in range(6)]
    try:
        for h in handles:
            assert h.join(timeout=120).rounds == 2
        assert proc.wait(timeout=60) == 0
    finally:
        for h in handles:
            h.stop()
        if proc.poll() is None:
            proc.kill()
    assert [m["clients_ok"] for m in read_metrics(tmp_path / "coord")] == [6, 6]
    assert not [e for e in read_events(tmp_path / "coord" / "events.jsonl") if e.event == "client_dropped"]


def test_the_coordinator_shortens_the_gil_switch_interval_from_the_environment():
    """Process-wide, so in a process of its own: the env override applies, and a coordinator
    never lengthens an interval already shorter."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from fedgrid.server.serve import Coordinator\n"
        "from fedgrid.server.remote_fleet import RemoteFleet\n"
        "before = sys.getswitchinterval()\n"
        "Coordinator('127.0.0.1:0', RemoteFleet()).stop()\n"
        "after = sys.getswitchinterval()\n"
        "sys.setswitchinterval(0.0001)\n"
        "Coordinator('127.0.0.1:0', RemoteFleet()).stop()\n"
        "print(before, after, sys.getswitchinterval())\n"
    )
    env = {**os.environ, "FEDGRID_GIL_SWITCH_INTERVAL_S": "0.0025"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100, check=True
    )
    before, after, kept = (float(x) for x in out.stdout.split())
    assert (
        before == pytest.approx(0.005, rel=0.02)
        and after == pytest.approx(0.0025, rel=0.02)
        and kept == pytest.approx(0.0001, rel=0.02)
    )
