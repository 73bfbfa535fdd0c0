"""Nothing is held before it is checked: upload streams without a session take no transfer
slot, and one client (or connection) holds at most its share, so a storm of bogus streams
never starves an honest client (issue 26, item 2)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from datetime import timedelta

import grpc
import torch

from fedgrid.aggregation import FedAvg
from fedgrid.client import start_client
from fedgrid.client.runtime import Connection
from fedgrid.constants import MAX_STREAMS_PER_CONNECTION, MAX_TRANSFERS
from fedgrid.proto.tls import session_metadata
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import Schedule
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.types import FitIns

from harness import wait_until
from harness_clients import Named

UPLOAD = "/fedgrid.v1.Coordinator/UploadUpdate"
ROUNDS = 3


class Storm:
    """Waves of ``n`` UploadUpdate streams that never send a message, spread over
    ``channels`` connections, opened from an asyncio loop in a thread: each wave is opened
    in a fraction of a second, and the next follows as soon as every stream of the last one has ended, until
    ``stop``. Records each wave's status codes and how long its slowest stream lived."""

    def __init__(self, address: str, n: int, *, channels: int, metadata=None) -> None:
        self.address, self.n, self.channels_n, self.metadata = address, n, channels, metadata
        self.waves: list[tuple[list[grpc.StatusCode], list[str], float]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self._run(), self.loop)

    async def _run(self) -> None:
        self._stopping = asyncio.Event()
        # A subchannel pool of its own each: one connection per channel (gRPC shares one otherwise).
        local = [("grpc.use_local_subchannel_pool", 1)]
        channels = [grpc.aio.insecure_channel(self.address, options=local) for _ in range(self.channels_n)]
        methods = [
            c.stream_unary(UPLOAD, request_serializer=None, response_deserializer=None) for c in channels
        ]
        never = asyncio.Event()

        async def nothing():
            await never.wait()
            yield b""

        async def one(i: int) -> tuple[grpc.StatusCode, str]:
            try:
                await methods[i % len(methods)](nothing(), metadata=self.metadata)
                return grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details() or ""

        try:
            while not self._stopping.is_set():
                start = time.monotonic()
                calls = []
                for i in range(self.n):
                    calls.append(asyncio.ensure_future(one(i)))
                    if i % 64 == 63:  # paced, so that gRPC's queue of calls not yet served takes them all
                        await asyncio.sleep(0.02)
                ended = await asyncio.gather(*calls)
                self.waves.append(([c for c, _ in ended], [d for _, d in ended], time.monotonic() - start))
        finally:
            never.set()
            for c in channels:
                await c.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stopping.set)
        self._task.result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_a_thousand_sessionless_streams_never_starve_an_honest_client(small_state):
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=5))
    server = Coordinator("127.0.0.1:0", fleet, max_workers=8).start()
    strategy = FedAvg()
    strategy.initialize(initial_state=small_state)
    engine = RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=ROUNDS,
            min_clients=1,
            round_timeout=timedelta(seconds=60),
            join_timeout=timedelta(seconds=60),
            finish_timeout=timedelta(seconds=10),
        ),
    )
    # As many silent streams as the coordinator has transfer slots, from 4 connections (as
    # many streams as each connection may carry): on today's main they held every slot for
    # 60 s and every honest transfer was refused, "1024 transfers in flight".
    assert MAX_TRANSFERS == 4 * MAX_STREAMS_PER_CONNECTION == 1024
    storm = Storm(server.address, MAX_TRANSFERS, channels=4)
    honest = None
    try:
        wait_until(lambda: len(storm.waves) >= 1, timeout=60, what="the first wave of streams to end")
        honest = start_client(Named("honest"), server.address, poll_wait_s=1.0)
        runner = threading.Thread(target=engine.run, daemon=True)
        started = time.monotonic()
        runner.start()
        runner.join(120)
        assert not runner.is_alive(), "the run did not complete"
        run_s = time.monotonic() - started
        assert honest.join(30).rounds == ROUNDS
    finally:
        storm.stop()
        if honest is not None:
            honest.stop()
        server.stop(grace=0.5)
        fleet.close()
    # The honest client's update is every round's model: the initial one plus one per round.
    for name, tensor in small_state.items():
        torch.testing.assert_close(strategy.global_state[name], tensor + ROUNDS, rtol=0, atol=1e-5)
    assert [m.clients_ok for m in engine.history] == [1] * ROUNDS
    # Every bogus stream was refused at once, never held: UNAUTHENTICATED from the servicer,
    # or UNAVAILABLE from gRPC itself (a burst past its queue of calls not yet served is
    # refused with RST_STREAM), each wave of 1,024 over in seconds (the header deadline is
    # 10 s, the idle one 60 s), and the storm went on for the whole run.
    assert len(storm.waves) >= 2
    refused = 0
    for codes, details, wave_s in storm.waves:
        assert set(codes) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE}
        ours = [d for c, d in zip(codes, details) if c == grpc.StatusCode.UNAUTHENTICATED]
        assert all("no session token" in d for d in ours)
        refused += len(ours)
        assert wave_s < 15.0, wave_s  # on today's main: over 60 s, each stream held until the idle limit
    assert refused >= MAX_TRANSFERS
    # On today's main the honest transfers were refused until the streams timed out (60 s).
    assert run_s < 45.0, run_s


def _header(fleet: RemoteFleet, state, conn: Connection, task) -> bytes:
    from fedgrid.proto import serde

    info = serde.StreamInfo(
        run_id=fleet.run_id, task_id=task.task_id, round=task.round, client_id=conn.client_id, num_examples=3
    )
    return next(iter(serde.EncodedModel(state).frames(info, chunk_size=16)))


def test_one_client_and_one_connection_hold_only_their_share(small_state):
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    server = Coordinator(
        "127.0.0.1:0",
        fleet,
        max_workers=4,
        header_timeout_s=2.0,
        max_transfers_per_client=2,
        max_transfers_per_connection=5,
    ).start()
    honest, greedy = Connection(server.address), Connection(server.address)
    sessions = [Connection(server.address) for _ in range(3)]
    storms: list[Storm] = []
    try:
        honest.join(Named("honest"))
        greedy.join(Named("greedy"))
        # A session's silent streams: two admitted (then given up at the header deadline),
        # the rest refused at once, naming the client's share.
        storms.append(Storm(server.address, 6, channels=1, metadata=session_metadata(greedy.token)))
        wait_until(lambda: storms[0].waves, timeout=30, what="the greedy streams to end")
        codes, details, wave_s = storms[0].waves[0]
        assert sorted(c.name for c in codes) == ["DEADLINE_EXCEEDED"] * 2 + ["RESOURCE_EXHAUSTED"] * 4
        assert sum("limit 2 per client" in d for d in details) == 4
        assert sum("sent no header within 2s" in d for d in details) == 2
        storms[0].stop()
        # Three sessions multiplexed on one connection: five streams in all, whoever sends them.
        for i, conn in enumerate(sessions):
            conn.join(Named(f"shared-{i}"))
        channel_storm = _shared_connection(server.address, [c.token for c in sessions])
        assert sorted(c.name for c in channel_storm) == ["DEADLINE_EXCEEDED"] * 5 + ["RESOURCE_EXHAUSTED"]
        # Meanwhile the honest client's download and upload go through at once.
        info = next(c for c in fleet.live_clients() if c.name == "honest")
        rnd = threading.Thread(
            target=fleet.fit_round,
            kwargs=dict(
                server_round=1,
                global_state=small_state,
                assignments=[(info, FitIns(round=1))],
                timeout=timedelta(seconds=30),
            ),
        )
        rnd.start()
        task = honest.poll(10).task
        got = honest.download(task.task_id)
        update = OrderedDict((k, v + 1) for k, v in got.items())
        assert honest.upload(task.task_id, task.round, update, 3, {}) > 0
        rnd.join(30)
        assert not rnd.is_alive() and server.servicer.transfers == 0
        assert server.servicer.slots.by_client == {} and server.servicer.slots.by_connection == {}
    finally:
        for conn in [honest, greedy, *sessions]:
            conn.close()
        server.stop(grace=0.5)
        fleet.close()


def _shared_connection(address: str, tokens: list[str]) -> list[grpc.StatusCode]:
    """Two silent upload streams per session of ``tokens``, all on one connection; their codes."""

    async def run() -> list[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(address) as channel:
            method = channel.stream_unary(UPLOAD, request_serializer=None, response_deserializer=None)
            never = asyncio.Event()

            async def nothing():
                await never.wait()
                yield b""

            async def one(token: str) -> grpc.StatusCode:
                try:
                    await method(nothing(), metadata=session_metadata(token))
                    return grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    return exc.code()

            return list(await asyncio.gather(*(one(t) for t in tokens for _ in range(2))))

    return asyncio.run(run())
