"""Coordinator benchmark: per-round overhead with many clients, and peak memory while aggregating.

Two measurements, in one run:

- ``overhead``: for each client count (default 10, 100 and 500), a coordinator
  (``RoundEngine`` + ``RemoteFleet`` + ``Coordinator``, FedAvg over every live client) runs
  warm-up + measured rounds of a tiny model against lightweight clients on loopback. Each
  client is ``fedgrid.client.start`` (the SDK's run loop, with its heartbeat thread) in a
  thread of a client process holding many of them; its ``fit`` sleeps a fixed compute time
  and returns the global model plus one, reporting how long ``fit`` took. A round's overhead
  is its wall time (the engine's ``RoundMetrics.wall_s``) minus the slowest client's
  reported compute: everything the protocol adds (task fan-out, downloads, uploads,
  validation, spilling, aggregation) on both sides of the wire.
- ``memory``: a coordinator aggregates one round of ``--updates`` updates of a
  ``--params`` float32 model (default 50 updates of 25M parameters, 100 MB). Uploader
  processes hold the clients (``Connection`` of the client SDK), download the model once
  per process and upload ``global + 1`` for each of their clients one after another, so
  at most ``--upload-workers`` uploads are in flight. The coordinator reads its own
  ``/proc/self/status``: VmHWM (peak RSS), reset through ``/proc/self/clear_refs`` at each
  phase boundary (uploads, aggregation, commit), plus a 10 ms sampler of RssAnon and
  RssFile. The peak is reported as a multiple of the model size, raw and net of the
  process's RSS before the model existed (imports, gRPC server).

Every process is separate (spawned); servers bind port 0. Every client sends the same
model, so every weighted mean is exactly that model: both measurements report how far the
final global model is from it (``max |err|``; 0 when the aggregation is exact).

    python benchmarks/coordinator.py                              # 2 to 3 minutes on 2 cores
    python benchmarks/coordinator.py --clients 10,100 --rounds 3 --params 1M --updates 10
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection as Pipe
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import grpc
import torch

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.selection import Sampling
from fedgrid.client.api import Client, FitOutput
from fedgrid.constants import HEARTBEAT_INTERVAL_S, RETRY_MAX_ELAPSED_S, RETRY_MAX_WAIT_S
from fedgrid.types import ClientInfo, Failure, FitIns, FitRes, ModelState

__all__ = ["main", "run_benchmark"]

NUM_TENSORS = 4
MB = 1e6
#: Deadline for a process to start and report ready (interpreter, torch import, clients joined).
START_TIMEOUT_S = 120.0
#: Deadline of a whole scenario (all rounds and the end of the run).
RUN_TIMEOUT_S = 600.0
#: Deadline of one round; a round that needs it shows up as failed clients, not a hang.
ROUND_TIMEOUT_S = 120.0
#: How many clients one client process hosts (threads), at most.
CLIENTS_PER_PROCESS = 125
#: The uploaders of the memory run send no heartbeats; a long interval keeps them registered.
MEMORY_HEARTBEAT_S = 600.0


def make_state(num_params: int) -> ModelState:
    """A float32 model of ``num_params`` parameters in ``NUM_TENSORS`` tensors, the same in every process."""
    gen = torch.Generator().manual_seed(0)
    sizes = [num_params // NUM_TENSORS + (i < num_params % NUM_TENSORS) for i in range(NUM_TENSORS)]
    return OrderedDict((f"layer{i}.weight", torch.randn(n, generator=gen)) for i, n in enumerate(sizes))


def plus(state: Mapping[str, torch.Tensor], k: int) -> ModelState:
    """``state`` plus one, ``k`` times, in float32: what ``k`` rounds of the bench clients make of it."""
    out = OrderedDict((n, t.clone()) for n, t in state.items())
    for _ in range(k):
        out = OrderedDict((n, t + 1) for n, t in out.items())
    return out


def aggregate_error(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """How far the final model is from the exact answer: every client sent the same model, so
    every weighted mean is exactly that model. The values are O(1) (randn plus the round count)."""
    err = max(float((got[n].double() - want.double()).abs().max()) for n, want in expected.items())
    return {"aggregate_exact": err == 0.0, "aggregate_max_abs_error": err}


class BenchClient(Client):
    """Sleeps ``compute_s``, returns the global model plus one, reports ``fit``'s duration as ``compute_s``."""

    def __init__(self, name: str, compute_s: float = 0.0) -> None:
        self.name, self.compute_s = name, compute_s

    @property
    def num_examples(self) -> int:
        return 1

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        start = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes of one machine
        time.sleep(self.compute_s)
        out = OrderedDict((k, v + 1) for k, v in state.items())
        end = time.monotonic()
        return FitOutput(out, 1, {"compute_s": end - start, "fit_start": start, "fit_end": end})


# -- probes, in the coordinator process -----------------------------------------------------
def read_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process, in bytes."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


class MemoryProbe:
    """Peak RSS per phase: VmHWM reset at each boundary, plus a sampler of RssAnon/RssFile."""

    def __init__(self, interval_s: float = 0.01) -> None:
        self.phases: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._name = ""
        self._started = 0.0
        self._max: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._sample, args=(interval_s,), name="bench-memory", daemon=True
        )
        self._thread.start()

    def _sample(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            now = read_status()
            with self._lock:
                for key in ("VmRSS", "RssAnon", "RssFile"):
                    self._max[key] = max(self._max.get(key, 0), now[key])

    def phase(self, name: str) -> None:
        """Closes the current phase (records its peaks) and opens ``name``."""
        with self._lock:
            now = read_status()
            if self._name:
                self.phases.append(
                    {
                        "phase": self._name,
                        "seconds": time.monotonic() - self._started,
                        "peak_rss": max(now["VmHWM"], self._max.get("VmRSS", 0)),
                        "peak_anon_sampled": max(self._max.get("RssAnon", 0), now["RssAnon"]),
                        "peak_file_sampled": max(self._max.get("RssFile", 0), now["RssFile"]),
                        "end_rss": now["VmRSS"],
                    }
                )
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
            self._name, self._started, self._max = name, time.monotonic(), {}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)


class ProbeFedAvg(FedAvg):
    """FedAvg that records when each round is configured and aggregated, and the slowest compute."""

    def __init__(self, on_phase: Callable[[str], None] | None = None) -> None:
        super().__init__(sampling=Sampling(fraction_fit=1.0, min_fit_clients=1))
        self.on_phase = on_phase or (lambda name: None)
        self.marks: dict[int, dict[str, float]] = {}

    def configure_round(
        self, *, server_round: int, clients: Sequence[ClientInfo]
    ) -> list[tuple[ClientInfo, FitIns]]:
        self.marks[server_round] = {"configured": time.monotonic()}
        return super().configure_round(server_round=server_round, clients=clients)

    def aggregate(
        self, *, server_round: int, results: Sequence[FitRes], failures: Sequence[Failure]
    ) -> dict[str, float]:
        marks = self.marks[server_round]
        marks["aggregate_start"] = time.monotonic()
        marks["max_compute_s"] = max((float(r.metrics.get("compute_s", 0.0)) for r in results), default=0.0)
        starts = [float(r.metrics["fit_start"]) for r in results if "fit_start" in r.metrics]
        ends = [float(r.metrics["fit_end"]) for r in results if "fit_end" in r.metrics]
        marks["last_fit_start"] = max(
            starts, default=marks["configured"]
        )  # no result: no fan-out to speak of
        marks["last_fit_end"] = max(ends, default=marks["aggregate_start"])
        self.on_phase("aggregate")
        out = super().aggregate(server_round=server_round, results=results, failures=failures)
        self.on_phase("commit")
        marks["aggregate_end"] = time.monotonic()
        return out


# -- processes ----------------------------------------------------------------------------
@dataclass(frozen=True)
class CoordinatorSpec:
    clients: int
    rounds: int  # warm-up included
    num_params: int
    max_workers: int
    heartbeat_s: float
    memory: bool = False


def _coordinator_main(spec: CoordinatorSpec, pipe: Pipe) -> None:
    """Runs the coordinator; sends its address, then the per-round record (and memory phases)."""
    cleanup: list[Callable[[], None]] = []
    try:
        from fedgrid.server.engine import RoundEngine
        from fedgrid.server.parts import RunIO, Schedule
        from fedgrid.server.remote_fleet import RemoteFleet
        from fedgrid.server.serve import Coordinator

        fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=spec.heartbeat_s))
        cleanup.append(fleet.close)
        coordinator = Coordinator("127.0.0.1:0", fleet, max_workers=spec.max_workers).start()
        cleanup.append(lambda: coordinator.stop(grace=1.0))
        probe = MemoryProbe() if spec.memory else None
        baseline = read_status()
        if probe is not None:
            probe.phase("setup")
        strategy = ProbeFedAvg(on_phase=probe.phase if probe is not None else None)
        strategy.initialize(initial_state=make_state(spec.num_params))  # the argument is freed here
        if probe is not None:
            probe.phase("wait+uploads")
        with_model = read_status()
        pipe.send(("ok", coordinator.address))

        rounds: list[dict[str, Any]] = []
        last_cpu = time.process_time()

        def on_round(m: Any) -> None:
            nonlocal last_cpu
            cpu = time.process_time()
            rounds.append(
                {
                    "round": m.round,
                    "wall_s": m.wall_s,
                    "clients_ok": m.clients_ok,
                    "clients_failed": m.clients_failed,
                    "cpu_s": cpu - last_cpu,
                    **strategy.marks.get(m.round, {}),
                }
            )
            last_cpu = cpu

        engine = RoundEngine(
            strategy=strategy,
            fleet=fleet,
            schedule=Schedule(
                rounds=spec.rounds,
                min_clients=spec.clients,
                round_timeout=timedelta(seconds=ROUND_TIMEOUT_S),
                join_timeout=timedelta(seconds=START_TIMEOUT_S),
                finish_timeout=timedelta(seconds=15),
            ),
            io=RunIO(
                on_round=on_round,
            ),
        )
        final = engine.run()
        if probe is not None:
            probe.phase("")
            probe.close()
        if final is None:
            raise RuntimeError("the run was interrupted")
        error = aggregate_error(final, plus(make_state(spec.num_params), spec.rounds))
        pipe.send(
            (
                "ok",
                {
                    "rounds": rounds,
                    **error,
                    "baseline": baseline,
                    "with_model": with_model,
                    "phases": probe.phases if probe is not None else [],
                },
            )
        )
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
    finally:
        for step in reversed(cleanup):
            step()
        pipe.close()


@dataclass(frozen=True)
class SwarmSpec:
    address: str
    first: int
    count: int
    compute_s: float


def _swarm_main(spec: SwarmSpec, pipe: Pipe) -> None:
    """Runs ``count`` SDK clients as threads until the run ends; reports rounds served and errors."""
    crashed: list[str] = []
    threading.excepthook = lambda args: crashed.append(
        f"{args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: {args.exc_value}"
    )
    try:
        from fedgrid.client import start_client

        handles = [
            start_client(BenchClient(f"c{i:04d}", spec.compute_s), spec.address)
            for i in range(spec.first, spec.first + spec.count)
        ]
        pipe.send(("ok", len(handles)))
        deadline = time.monotonic() + RUN_TIMEOUT_S
        rounds: list[int] = []
        errors: list[str] = []
        for handle in handles:
            try:
                rounds.append(handle.join(max(1.0, deadline - time.monotonic())).rounds)
            except BaseException as exc:  # reported, the run's numbers say what it cost
                handle.stop()
                errors.append(repr(exc))
        pipe.send(
            (
                "ok",
                {"rounds": rounds, "errors": errors, "thread_crashes": crashed, "cpu_s": time.process_time()},
            )
        )
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
    finally:
        pipe.close()


#: Protocol clients one load-generator process hosts, and how many share a channel (connection).
AIO_CLIENTS_PER_PROCESS = 1000
AIO_CLIENTS_PER_CHANNEL = 50
#: Joins one load-generator process has in flight at once.
JOIN_CONCURRENCY = 50


#: What the SDK retries (``fedgrid.client.runtime.TRANSIENT``), with backoff.
_TRANSIENT = (
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


async def _retrying(call: Callable[[], Any]) -> Any:
    """Awaits ``call()``, retrying transient failures with jittered exponential backoff (capped at
    ``RETRY_MAX_WAIT_S``) for up to ``RETRY_MAX_ELAPSED_S``, as the SDK does."""
    import asyncio
    import random

    give_up = time.monotonic() + RETRY_MAX_ELAPSED_S
    attempt = 0
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _TRANSIENT or time.monotonic() >= give_up:
                raise
            await asyncio.sleep(random.uniform(0, min(RETRY_MAX_WAIT_S, 0.2 * 2**attempt)))
            attempt += 1


async def _protocol_client(channel: Any, name: str, compute_s: float, join_gate: Any) -> int:
    """One lightweight protocol client, as a real one behaves on the wire: Join, heartbeats,
    long polls, a chunked download, ``compute_s`` of "training", a chunked upload of
    ``global + 1`` with the same metrics as ``BenchClient``. Returns the rounds it served."""
    import asyncio

    from fedgrid.proto import fedgrid_pb2 as pb
    from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc
    from fedgrid.proto import serde
    from fedgrid.proto.tls import session_metadata

    stub = pb_grpc.CoordinatorStub(channel)
    download = channel.unary_stream(
        "/fedgrid.v1.Coordinator/DownloadModel",
        request_serializer=pb.DownloadRequest.SerializeToString,
        response_deserializer=None,
    )
    upload = channel.stream_unary(
        "/fedgrid.v1.Coordinator/UploadUpdate",
        request_serializer=None,
        response_deserializer=pb.UploadReply.FromString,
    )
    request = pb.JoinRequest(
        name=name, num_examples=1, capabilities=pb.Capabilities(device="cpu", codecs=["none"])
    )

    async def join_once() -> Any:
        async with (
            join_gate
        ):  # a process's clients join at most JOIN_CONCURRENCY at a time, as a fleet coming online does
            return await _retrying(lambda: stub.Join(request, timeout=START_TIMEOUT_S))

    join = await join_once()
    cid, token = join.client_id, join.session_token
    rejoins = 0

    polling = [False]

    async def beat() -> None:  # as the SDK: no heartbeat while a long poll is in flight
        while True:
            await asyncio.sleep(join.heartbeat_interval_s)
            if polling[0]:
                continue
            try:
                await stub.Heartbeat(
                    pb.HeartbeatRequest(client_id=cid), metadata=session_metadata(token), timeout=30
                )
            except Exception:  # noqa: BLE001 - the poll loop decides
                pass

    heart = asyncio.ensure_future(beat())
    rounds = 0
    try:
        while True:
            polling[0] = True
            try:
                reply = await stub.PollTask(
                    pb.PollRequest(client_id=cid, wait_s=10), metadata=session_metadata(token), timeout=40
                )
            except grpc.aio.AioRpcError as exc:  # as the SDK: transient failures are retried with backoff
                if (
                    exc.code() == grpc.StatusCode.UNAUTHENTICATED and rejoins < 3
                ):  # as the SDK: dropped, so join again
                    rejoins += 1
                    print(
                        f"client {name}: session refused ({exc.details()}): joining again",
                        file=sys.stderr,
                        flush=True,
                    )
                    join = await join_once()
                    cid, token = join.client_id, join.session_token
                    continue
                if exc.code() not in _TRANSIENT:
                    raise
                await asyncio.sleep(0.5)
                continue
            finally:
                polling[0] = False
            kind = reply.WhichOneof("reply")
            if kind == "finished":
                return rounds
            if kind != "task":
                continue
            task = reply.task

            async def fetch() -> Any:
                asm = serde.ModelAssembler()
                async for frame in download(
                    pb.DownloadRequest(client_id=cid, task_id=task.task_id),
                    metadata=session_metadata(token),
                    timeout=60,
                ):
                    asm.feed(frame)
                return asm.finish()[1]

            state = await _retrying(fetch)
            start = time.monotonic()
            await asyncio.sleep(compute_s)
            out = OrderedDict((k, v + 1) for k, v in state.items())
            end = time.monotonic()
            info = serde.StreamInfo(
                run_id=join.run_id,
                task_id=task.task_id,
                round=task.round,
                client_id=cid,
                num_examples=1,
                metrics={"compute_s": end - start, "fit_start": start, "fit_end": end},
            )
            frames = list(serde.EncodedModel(out).frames(info, chunk_size=join.chunk_size or (1 << 20)))

            async def stream() -> Any:
                for f in frames:
                    yield f

            try:
                await _retrying(lambda: upload(stream(), metadata=session_metadata(token), timeout=60))
            except grpc.aio.AioRpcError as exc:
                if (
                    exc.code() == grpc.StatusCode.ALREADY_EXISTS
                ):  # a retry of an upload that had landed: done, as the SDK reads it
                    pass
                elif exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the round closed first
                    continue
                else:
                    raise
            rounds += 1
    finally:
        heart.cancel()


def _aio_swarm_main(spec: SwarmSpec, pipe: Pipe) -> None:
    """Runs ``count`` protocol clients on one asyncio loop (``AIO_CLIENTS_PER_CHANNEL`` per
    connection) until the run ends; reports rounds served and errors, like ``_swarm_main``."""
    try:
        import asyncio

        async def main() -> dict[str, Any]:
            channels = [
                grpc.aio.insecure_channel(spec.address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(math.ceil(spec.count / AIO_CLIENTS_PER_CHANNEL))
            ]
            gate = asyncio.Semaphore(JOIN_CONCURRENCY)

            async def reported(i: int) -> int:
                name = f"c{spec.first + i:05d}"
                try:
                    return await _protocol_client(
                        channels[i // AIO_CLIENTS_PER_CHANNEL], name, spec.compute_s, gate
                    )
                except Exception as exc:  # told at once: the benchmark may be stopped before the end
                    print(f"protocol client {name} failed: {exc!r}"[:400], file=sys.stderr, flush=True)
                    raise

            tasks = [asyncio.ensure_future(reported(i)) for i in range(spec.count)]
            pipe.send(("ok", len(tasks)))
            done = await asyncio.gather(*tasks, return_exceptions=True)
            for c in channels:
                await c.close()
            return {
                "rounds": [d for d in done if isinstance(d, int)],
                "errors": [repr(d) for d in done if not isinstance(d, int)],
                "thread_crashes": [],
                "cpu_s": time.process_time(),
            }

        pipe.send(("ok", asyncio.run(asyncio.wait_for(main(), RUN_TIMEOUT_S))))
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
    finally:
        pipe.close()


def _poll_until(conn: Any, kind: str, deadline: float) -> Any:
    while time.monotonic() < deadline:
        reply = conn.poll(min(10.0, max(0.1, deadline - time.monotonic())))
        if reply.WhichOneof("reply") == kind:
            return reply
    raise TimeoutError(f"no {kind!r} reply from the coordinator in time")


def _uploader_main(spec: SwarmSpec, pipe: Pipe) -> None:
    """``count`` SDK connections of one process: one download, then each uploads ``global + 1`` in turn."""
    try:
        from fedgrid.client.runtime import Connection

        conns = [Connection(spec.address) for _ in range(spec.count)]
        for i, conn in enumerate(conns):
            conn.join(BenchClient(f"u{spec.first + i:04d}"))
        pipe.send(("ok", len(conns)))
        deadline = time.monotonic() + RUN_TIMEOUT_S
        task = _poll_until(conns[0], "task", deadline).task
        update = OrderedDict((k, v + 1) for k, v in conns[0].download(task.task_id).items())
        seconds: list[float] = []
        for conn in conns:
            mine = _poll_until(conn, "task", deadline).task
            if mine.task_id != task.task_id:
                raise RuntimeError(
                    f"client {conn.client_id} got task {mine.task_id}, expected {task.task_id}"
                )
            t0 = time.perf_counter()
            conn.upload(task.task_id, task.round, update, 1, {})
            seconds.append(time.perf_counter() - t0)
        for conn in conns:
            _poll_until(conn, "finished", deadline)
            conn.close()
        pipe.send(("ok", {"upload_s": seconds}))
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
    finally:
        pipe.close()


class Child:
    """A spawned process and the parent's end of its pipe; every wait has a deadline."""

    def __init__(self, ctx: SpawnContext, name: str, target: Callable[..., None], spec: Any) -> None:
        self.name = name
        self.pipe, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(spec, child), name=name, daemon=True)
        self.process.start()
        child.close()

    def reply(self, timeout: float) -> Any:
        if not self.pipe.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer within {timeout:.0f}s")
        status, value = self.pipe.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name} failed:\n{value}")
        return value

    def stop(self) -> None:
        self.process.join(10.0)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)


def _run(
    ctx: SpawnContext, spec: CoordinatorSpec, clients: Callable[[str], list[Child]]
) -> tuple[dict[str, Any], list[Any]]:
    """Starts the coordinator, then the client processes; returns what each reported at the end."""
    children: list[Child] = []
    try:
        coordinator = Child(ctx, "coordinator", _coordinator_main, spec)
        children.append(coordinator)
        address = coordinator.reply(START_TIMEOUT_S)
        swarm = clients(address)
        children += swarm
        for child in swarm:
            child.reply(START_TIMEOUT_S)
        report = coordinator.reply(RUN_TIMEOUT_S)
        return report, [child.reply(RUN_TIMEOUT_S) for child in swarm]
    finally:
        for child in reversed(children):
            child.stop()


# -- the two measurements -------------------------------------------------------------------
def measure_overhead(
    ctx: SpawnContext,
    *,
    clients: int,
    rounds: int,
    warmup: int,
    num_params: int,
    compute_s: float,
    max_workers: int,
    load: str = "aio",
    heartbeat_s: float = HEARTBEAT_INTERVAL_S,
) -> dict[str, Any]:
    """Median round wall time, slowest compute and overhead over the measured rounds.

    ``load``: ``aio`` (lightweight asyncio protocol clients, ``AIO_CLIENTS_PER_PROCESS`` per
    process) or ``sdk`` (``fedgrid.client.start`` threads, ``CLIENTS_PER_PROCESS`` per process).
    """
    procs = math.ceil(clients / (AIO_CLIENTS_PER_PROCESS if load == "aio" else CLIENTS_PER_PROCESS))
    shares = [clients // procs + (i < clients % procs) for i in range(procs)]
    firsts = [sum(shares[:i]) for i in range(procs)]
    spec = CoordinatorSpec(
        clients=clients,
        rounds=warmup + rounds,
        num_params=num_params,
        max_workers=max_workers,
        heartbeat_s=heartbeat_s,
    )
    started = time.perf_counter()
    report, swarms = _run(
        ctx,
        spec,
        lambda address: [
            Child(
                ctx,
                f"clients-{i}",
                _aio_swarm_main if load == "aio" else _swarm_main,
                SwarmSpec(address, firsts[i], shares[i], compute_s),
            )
            for i in range(procs)
        ],
    )
    measured = report["rounds"][warmup:]
    overheads = [r["wall_s"] - r["max_compute_s"] for r in measured]
    errors = [e for s in swarms for e in s["errors"]]
    crashes = [e for s in swarms for e in s["thread_crashes"]]

    def median(key: Callable[[dict[str, Any]], float]) -> float:
        return statistics.median(key(r) for r in measured)

    row = {
        "clients": clients,
        "max_workers": max_workers,
        "client_processes": procs,
        "rounds": len(measured),
        "compute_s": compute_s,
        "wall_s": median(lambda r: r["wall_s"]),
        "max_compute_s": median(lambda r: r["max_compute_s"]),
        "overhead_s": statistics.median(overheads),
        "overhead_per_client_ms": statistics.median(overheads) / clients * 1e3,
        # Where the round goes: task open -> the last client started computing (poll wake-up,
        # download), the last compute ended -> every update accepted, and the aggregation.
        "fanout_s": median(lambda r: r["last_fit_start"] - r["configured"]),
        "collect_s": median(lambda r: r["aggregate_start"] - r["last_fit_end"]),
        "aggregate_s": median(lambda r: r["aggregate_end"] - r["aggregate_start"]),
        "coordinator_cpu_s": median(lambda r: r["cpu_s"]),
        # All client processes together, averaged over every round (joins and warm-up included).
        "clients_cpu_s": sum(s["cpu_s"] for s in swarms) / spec.rounds,
        "clients_failed": sum(r["clients_failed"] for r in report["rounds"]),
        "client_errors": len(errors),
        "client_thread_crashes": len(crashes),
        "aggregate_exact": report["aggregate_exact"],
        "aggregate_max_abs_error": report["aggregate_max_abs_error"],
        "per_round": report["rounds"],
        "client_error_samples": errors[:3],
        "client_thread_crash_samples": crashes[:3],
    }
    print(
        f"  {clients} clients (max_workers {max_workers}): {len(measured)} rounds (+{warmup} warm-up) "
        f"in {time.perf_counter() - started:.1f}s",
        flush=True,
    )
    return row


def measure_memory(
    ctx: SpawnContext, *, num_params: int, updates: int, upload_workers: int
) -> dict[str, Any]:
    """Peak RSS of the coordinator over one round of ``updates`` uploads and their aggregation."""
    workers = min(upload_workers, updates)
    shares = [updates // workers + (i < updates % workers) for i in range(workers)]
    spec = CoordinatorSpec(
        clients=updates,
        rounds=1,
        num_params=num_params,
        max_workers=256,
        heartbeat_s=MEMORY_HEARTBEAT_S,
        memory=True,
    )
    started = time.perf_counter()
    report, uploaders = _run(
        ctx,
        spec,
        lambda address: [
            Child(ctx, f"uploader-{i}", _uploader_main, SwarmSpec(address, sum(shares[:i]), shares[i], 0.0))
            for i in range(workers)
        ],
    )
    model_bytes = num_params * 4
    base = report["baseline"]["VmRSS"]
    phases = [p for p in report["phases"] if p["phase"] != "setup"]
    peak = max(p["peak_rss"] for p in phases)
    upload_s = [s for u in uploaders for s in u["upload_s"]]
    print(
        f"  memory: {updates} updates of {num_params * 4 / MB:.0f} MB in {time.perf_counter() - started:.1f}s",
        flush=True,
    )
    return {
        "params": num_params,
        "model_bytes": model_bytes,
        "updates": updates,
        "upload_workers": workers,
        "baseline_rss": base,
        "baseline_anon": report["baseline"]["RssAnon"],
        "rss_with_model": report["with_model"]["VmRSS"],
        "rss_after_round": phases[-1]["end_rss"],
        "peak_rss": peak,
        "multiple_raw": peak / model_bytes,
        "multiple_net": (peak - base) / model_bytes,
        "goal_multiple": 3.0,
        "meets_goal_net": (peak - base) / model_bytes <= 3.0,
        "phases": {p["phase"]: {**p, "multiple_net": (p["peak_rss"] - base) / model_bytes} for p in phases},
        "upload_s_median": statistics.median(upload_s),
        "aggregate_exact": report["aggregate_exact"],
        "aggregate_max_abs_error": report["aggregate_max_abs_error"],
        "round": report["rounds"][0],
    }


def run_benchmark(
    *,
    clients: list[int],
    rounds: int,
    warmup: int,
    num_params: int,
    compute_s: float,
    max_workers: list[int | None],
    updates: int,
    memory_params: int,
    upload_workers: int,
    load: str = "aio",
    heartbeat_s: float = HEARTBEAT_INTERVAL_S,
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    rows = []
    for n in clients:
        for workers in max_workers:
            threads = workers if workers is not None else auto_workers(n)
            try:
                rows.append(
                    measure_overhead(
                        ctx,
                        clients=n,
                        rounds=rounds,
                        warmup=warmup,
                        num_params=num_params,
                        compute_s=compute_s,
                        max_workers=threads,
                        load=load,
                        heartbeat_s=heartbeat_s,
                    )
                )
            except (RuntimeError, TimeoutError) as exc:  # a scenario that breaks is a result too
                reason = str(exc).strip().splitlines()[-1]
                print(f"  {n} clients (max_workers {threads}): FAILED: {reason}", flush=True)
                rows.append({"clients": n, "max_workers": threads, "error": reason})
    memory = (
        measure_memory(ctx, num_params=memory_params, updates=updates, upload_workers=upload_workers)
        if updates
        else None
    )
    return {
        "benchmark": "coordinator",
        "unit": "seconds (median over measured rounds); bytes",
        "config": {
            "clients": clients,
            "rounds": rounds,
            "warmup": warmup,
            "params": num_params,
            "compute_s": compute_s,
            "max_workers": ["auto" if w is None else w for w in max_workers],
            "updates": updates,
            "memory_params": memory_params,
            "upload_workers": upload_workers,
            "num_tensors": NUM_TENSORS,
            "dtype": "float32",
            "heartbeat_s": heartbeat_s,
        },
        "environment": {
            "python": platform.python_version(),
            "grpcio": grpc.__version__,
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "overhead": rows,
        "memory": memory,
    }


def auto_workers(clients: int) -> int:
    """RPC threads for ``clients``: the default 256, or more when every client's long poll,
    plus its heartbeat and a transfer, needs a thread of its own."""
    return max(256, 2 * clients + 64)


# -- report ---------------------------------------------------------------------------------
def print_report(report: dict[str, Any]) -> None:
    if report["overhead"]:
        print_overhead(report["overhead"])
    if report["memory"] is not None:
        print_memory(report["memory"])


def print_overhead(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'clients':>7} {'workers':>7} {'rounds':>6} | {'wall s':>7} {'compute s':>9} {'overhead s':>10} "
        f"{'per client ms':>13} | {'fan-out s':>9} {'collect s':>9} {'agg s':>6} | {'coord CPU s':>11} "
        f"{'clients CPU s':>13} | {'failed':>6} {'max |err|':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        if "error" in r:
            print(f"{r['clients']:>7} {r['max_workers']:>7} FAILED: {r['error']}")
            continue
        print(
            f"{r['clients']:>7} {r['max_workers']:>7} {r['rounds']:>6} | {r['wall_s']:>7.3f} {r['max_compute_s']:>9.3f} "
            f"{r['overhead_s']:>10.3f} {r['overhead_per_client_ms']:>13.2f} | {r['fanout_s']:>9.3f} {r['collect_s']:>9.3f} "
            f"{r['aggregate_s']:>6.3f} | {r['coordinator_cpu_s']:>11.3f} {r['clients_cpu_s']:>13.3f} | "
            f"{r['clients_failed'] + r['client_errors']:>6} {r['aggregate_max_abs_error']:>9.1e}"
        )
    crashes = sum(r.get("client_thread_crashes", 0) for r in rows)
    if crashes:
        sample = next(r["client_thread_crash_samples"][0] for r in rows if r.get("client_thread_crashes"))
        print(f"client threads that died of an uncaught exception: {crashes} (e.g. {sample})")


def print_memory(m: dict[str, Any]) -> None:
    print()
    print(
        f"memory: {m['updates']} updates of a {m['model_bytes'] / MB:.0f} MB model, {m['upload_workers']} uploads in flight at most"
    )
    print(
        f"  baseline RSS (before the model) {m['baseline_rss'] / MB:.0f} MB (anon {m['baseline_anon'] / MB:.0f} MB), "
        f"with the model {m['rss_with_model'] / MB:.0f} MB, after the round {m['rss_after_round'] / MB:.0f} MB"
    )
    for name, p in m["phases"].items():
        print(
            f"  {name:<13} {p['seconds']:>6.1f}s  peak RSS {p['peak_rss'] / MB:>7.0f} MB = {p['multiple_net']:>5.2f}x model net of baseline"
            f"  (anon {p['peak_anon_sampled'] / MB:.0f} MB, file {p['peak_file_sampled'] / MB:.0f} MB sampled)"
        )
    verdict = "meets" if m["multiple_net"] <= m["goal_multiple"] else "misses"
    print(
        f"  peak {m['peak_rss'] / MB:.0f} MB = {m['multiple_raw']:.2f}x the model raw (the baseline alone is "
        f"{m['baseline_rss'] / m['model_bytes']:.2f}x), {m['multiple_net']:.2f}x net of baseline: {verdict} the goal of "
        f"{m['goal_multiple']:.0f}x; aggregate max |error| {m['aggregate_max_abs_error']:.1e}"
    )


def parse_size(text: str) -> int:
    """``25M`` -> 25_000_000 parameters (K, M, G are powers of 1000)."""
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    value = int(float(text[:-1] if scale > 1 else text) * scale)
    if value < NUM_TENSORS:
        raise argparse.ArgumentTypeError(f"size {text!r}: need at least {NUM_TENSORS} parameters")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--clients",
        default="10,100,500",
        help="concurrent clients per overhead scenario, comma-separated (empty skips them)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per scenario (default 5)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="unmeasured rounds first (default 1; it includes the joins)"
    )
    parser.add_argument(
        "--compute-ms",
        type=float,
        default=100.0,
        help="each client's fixed compute time per round (default 100)",
    )
    parser.add_argument(
        "--small-params",
        type=parse_size,
        default=4096,
        help="model size of the overhead scenarios (default 4096)",
    )
    parser.add_argument(
        "--max-workers",
        default="256",
        help="Coordinator(max_workers=...): RPC threads, comma-separated to compare (default 256, the "
        "coordinator's default; 'auto' = max(256, 2*clients+64))",
    )
    parser.add_argument(
        "--params", type=parse_size, default=25_000_000, help="model size of the memory run (default 25M)"
    )
    parser.add_argument(
        "--updates",
        type=int,
        default=50,
        help="updates aggregated in the memory run (default 50; 0 skips it)",
    )
    parser.add_argument(
        "--upload-workers", type=int, default=2, help="uploader processes, i.e. uploads in flight (default 2)"
    )
    parser.add_argument(
        "--load",
        choices=("aio", "sdk"),
        default="aio",
        help="clients: aio (asyncio protocol clients, 1000 per process) or sdk (fedgrid.client threads, 125 per process)",
    )
    parser.add_argument(
        "--heartbeat-s",
        type=float,
        default=HEARTBEAT_INTERVAL_S,
        help=f"the coordinator's heartbeat interval (default {HEARTBEAT_INTERVAL_S:g}; a client silent for 3 is dropped). "
        "Thousands of load clients sharing 2 cores with the coordinator fall behind on heartbeats: raise it there",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "coordinator.json"
    )
    args = parser.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",") if c.strip()]
    max_workers = [None if w.strip() == "auto" else int(w) for w in args.max_workers.split(",") if w.strip()]
    if (
        (clients and min(clients) < 1)
        or not max_workers
        or args.rounds < 1
        or args.warmup < 0
        or args.updates < 0
        or args.upload_workers < 1
    ):
        parser.error(
            "need client counts >= 1, --rounds >= 1, --warmup >= 0, --updates >= 0, --upload-workers >= 1"
        )

    print(
        f"coordinator benchmark: clients {','.join(map(str, clients))}, {args.rounds} rounds (+{args.warmup} warm-up), "
        f"compute {args.compute_ms:.0f} ms; memory: {args.updates} updates of {args.params} params",
        flush=True,
    )
    report = run_benchmark(
        clients=clients,
        rounds=args.rounds,
        warmup=args.warmup,
        num_params=args.small_params,
        compute_s=args.compute_ms / 1e3,
        max_workers=max_workers,
        updates=args.updates,
        memory_params=args.params,
        upload_workers=args.upload_workers,
        load=args.load,
        heartbeat_s=args.heartbeat_s,
    )
    print()
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
