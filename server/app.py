"""``run_coordinator``: the gRPC server, the fleet and the round engine wired together."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from concurrent import futures
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedgrid.config import Config
from fedgrid.determinism import environment, intra_op_threads
from fedgrid.events import Event, EventLog
from fedgrid.constants import (
    FINISH_GRACE_S,
    GIL_SWITCH_INTERVAL_S,
    KEEPALIVE_TIME_S,
    KEEPALIVE_TIMEOUT_S,
    MAX_CONNECTION_IDLE_S,
    MAX_MESSAGE_BYTES,
    MAX_STREAMS_PER_CONNECTION,
    MAX_TRANSFERS,
    MIN_CLIENT_PING_INTERVAL_S,
    STREAM_IDLE_S,
)
from fedgrid.errors import ConfigError
from fedgrid.plugins import model_state
from fedgrid.runlog import RunWriter, load_model
from fedgrid.server.bounds import build_bounds
from fedgrid.server.engine import EvaluateFn, RoundEngine
from fedgrid.server.codec_policy import build_codec_policy
from fedgrid.server.grpc_fleet import GrpcFleet
from fedgrid.server.memory import return_large_buffers_to_the_system
from fedgrid.server.service import SERVICE, CoordinatorServicer, add_to_server
from fedgrid.server.state import StateStore
from fedgrid.server.strategies import build_strategy
from fedgrid.types import ModelState

__all__ = ["Coordinator", "run_coordinator", "coordinator_model", "SERVICE_NAME"]

log = logging.getLogger(__name__)

SERVICE_NAME = SERVICE
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    ("grpc.keepalive_time_ms", int(KEEPALIVE_TIME_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_CLIENT_PING_INTERVAL_S * 1000)),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.max_connection_idle_ms", int(MAX_CONNECTION_IDLE_S * 1000)),
]


class Coordinator:
    """A listening gRPC server (``grpc.aio``) over a ``GrpcFleet``; ``port`` is known once constructed.

    The server runs on an asyncio event loop in a thread of its own, so the calling thread
    (the round engine) is free; idle long polls hold no thread.

    Args:
        listen: ``HOST:PORT``; port 0 binds a free port.
        fleet: the fleet the servicer serves.
        max_workers: threads for CPU work (encoding downloads, checking and spilling uploads).
        interceptors: ``grpc.aio`` server interceptors (authentication, logging, fault injection).
        max_transfers: downloads and uploads in flight at once; more get RESOURCE_EXHAUSTED.
        stream_idle_s: an upload stream silent this long is given up (DEADLINE_EXCEEDED).

    Connection limits (streams per connection, keepalive, idle connections) are the
    ``GRPC_OPTIONS``, from ``fedgrid.constants`` (``FEDGRID_*`` overrides).
    """

    def __init__(
        self,
        listen: str,
        fleet: GrpcFleet,
        *,
        max_workers: int = 256,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        max_transfers: int = MAX_TRANSFERS,
        stream_idle_s: float = STREAM_IDLE_S,
    ) -> None:
        self.fleet = fleet
        return_large_buffers_to_the_system()  # model-sized buffers go back to the OS when freed
        # Shorter GIL turns (process-wide, never longer than already set): see GIL_SWITCH_INTERVAL_S.
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self.executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="fedgrid-cpu")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fedgrid-aio", daemon=True)
        self._thread.start()

        async def build() -> tuple[grpc.aio.Server, health_aio.HealthServicer, int]:
            server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=list(interceptors))
            self.servicer = CoordinatorServicer(fleet, self.executor, max_transfers=max_transfers, stream_idle_s=stream_idle_s)
            add_to_server(self.servicer, server)
            checker = health_aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(checker, server)
            return server, checker, server.add_insecure_port(listen)

        try:
            self.server, self.health, self.port = self._run(build())
        except Exception:
            self._shutdown_loop()
            raise
        if self.port == 0:
            self._shutdown_loop()
            raise OSError(f"could not bind {listen}")
        host = listen.rpartition(":")[0]
        self.address = f"{'127.0.0.1' if host in ('0.0.0.0', '[::]') else host}:{self.port}"

    def _run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self.executor.shutdown(wait=False, cancel_futures=True)

    def start(self) -> "Coordinator":
        self._run(self.server.start())
        self.set_serving(True)
        return self

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING

        async def set_all() -> None:
            for name in ("", SERVICE_NAME):
                await self.health.set(name, status)

        self._run(set_all())

    def stop(self, grace: float = 5.0) -> None:
        """NOT_SERVING, then in-flight RPCs get ``grace`` seconds to finish."""
        if not self._thread.is_alive():
            return
        self.set_serving(False)
        try:
            self._run(self.server.stop(grace), timeout=grace + 5.0)
        finally:
            self._shutdown_loop()


def run_coordinator(
    config: Config,
    *,
    initial: ModelState | None = None,
    evaluate_fn: EvaluateFn | None = None,
    ready: threading.Event | None = None,
    on_event: Callable[[Event], None] | None = None,
) -> ModelState | None:
    """Serves ``config.rounds`` rounds and returns the final global model.

    The initial global model is ``initial``, else ``coordinator_model(config)``: the
    ``initial_model`` safetensors file or the ``MODULE:FACTORY`` of ``model``. This layer
    never imports dataset code; ``fedgrid coordinator`` builds the built-in datasets'
    models and their server-side evaluation (``evaluate_fn``) itself.

    With ``config.state_dir`` it resumes after the last committed round. SIGTERM stops it
    gracefully (returns ``None``; the committed state stays for a restart).

    The bound address is printed and written to ``RUN_DIR/address`` so that scripts using
    port 0 can find it. Events (``fedgrid.events``) are appended to ``RUN_DIR/events.jsonl``
    and, with ``on_event``, handed to it on the emitting thread (after the file has them).
    Aggregation runs with ``config.threads`` intra-op threads (restored on return), which
    ``config.toml`` records with the torch version.
    """
    with intra_op_threads(config.threads) as threads:
        return _serve(config, threads, initial, evaluate_fn, ready, on_event)


def coordinator_model(config: Config) -> ModelState | None:
    """The initial global model that ``config`` names without dataset code: the
    ``initial_model`` safetensors file, or the seeded ``MODULE:FACTORY`` of ``model``;
    ``None`` for a built-in model name.

    Raises:
        ConfigError: a missing or unreadable file, or a factory that cannot build a model.
    """
    if config.initial_model:
        path = Path(config.initial_model)
        if not path.is_file():
            raise ConfigError("initial_model", f"file {config.initial_model!r} does not exist")
        try:
            return load_model(path)
        except Exception as exc:  # safetensors raises its own error types
            raise ConfigError("initial_model", f"{config.initial_model!r} is not a readable safetensors file: {exc}") from None
    if ":" in config.model:
        return model_state(config.model, seed=config.seed)
    return None


def _serve(
    config: Config,
    threads: int,
    initial: ModelState | None,
    evaluate_fn: EvaluateFn | None,
    ready: threading.Event | None,
    on_event: Callable[[Event], None] | None,
) -> ModelState | None:
    if initial is None:
        initial = coordinator_model(config)
    if initial is None:
        raise ConfigError(
            "model", f"{config.model or 'the dataset default'!r} is a built-in model: run_coordinator needs initial=..., "
            "--model MODULE:FACTORY or --initial-model FILE.safetensors (the fedgrid coordinator command builds built-in models)"
        )
    store = StateStore(config.state_dir) if config.state_dir else None
    strategy = build_strategy(config, num_clients=config.min_clients)
    strategy.initialize(initial_state=initial)
    writer = RunWriter(config.out, {**config.to_dict(), "threads": threads}, environment=environment(threads_requested=config.threads))
    events = EventLog(writer.dir / "events.jsonl")
    if on_event is not None:
        events.subscribe(on_event)
    fleet = GrpcFleet(
        events=events,
        heartbeat_interval=timedelta(seconds=config.heartbeat_interval_s),
        chunk_size=config.chunk_size,
        spill_dir=Path(config.state_dir) / "updates" if config.state_dir else None,
        codec_policy=build_codec_policy(config),
        downlink_codec=config.downlink_codec,
        bounds=build_bounds(config),
    )
    coordinator = Coordinator(config.listen, fleet, max_workers=config.max_workers).start()
    address_tmp = Path(config.out) / "address.tmp"  # atomic: a script waiting for the file never reads half of it
    address_tmp.write_text(coordinator.address + "\n")
    os.replace(address_tmp, Path(config.out) / "address")
    print(f"fedgrid coordinator listening on {coordinator.address} (run {fleet.run_id}, dir {config.out}, {threads} threads)", flush=True)
    events.emit("started", run_id=fleet.run_id, address=coordinator.address, threads=threads)
    if ready is not None:
        ready.set()

    def on_round(m):
        acc = "" if m.accuracy is None else f" accuracy {m.accuracy:.4f}"
        print(f"round {m.round}/{config.rounds} loss {m.loss if m.loss is None else round(m.loss, 4)}{acc} clients {m.clients_ok} ok {m.clients_failed} failed ({m.wall_s:.2f}s)", flush=True)

    engine = RoundEngine(
        strategy=strategy,
        fleet=fleet,
        rounds=config.rounds,
        min_clients=config.min_clients,
        round_timeout=timedelta(seconds=config.round_timeout_s),
        join_timeout=timedelta(seconds=config.join_timeout_s),
        evaluate_fn=evaluate_fn,
        writer=writer,
        on_round=on_round,
        finish_timeout=timedelta(seconds=FINISH_GRACE_S),
        store=store,
        events=events,
    )

    def on_term(signum: int, frame: object) -> None:
        # Graceful: report NOT_SERVING, abandon the open round (it is redone on restart),
        # then stop() below lets in-flight RPCs finish within the grace period.
        log.info("signal %d: stopping after in-flight requests; the last committed round is kept", signum)
        coordinator.set_serving(False)
        engine.stop()

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_term) if in_main else None
    try:
        final = engine.run()
    finally:
        coordinator.stop(grace=5.0)
        fleet.close()
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    if final is None:
        print(f"stopped; state up to round {len(engine.history)} is committed", flush=True)
        events.emit("stopped", committed=len(engine.history))
        events.close()
        return None
    events.close()
    print(f"run finished: final model in {writer.dir / 'model.safetensors'}", flush=True)
    return final
