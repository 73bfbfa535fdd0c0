"""``run_coordinator``: the gRPC server, the fleet and the round engine wired together.

``Coordinator`` is the listening gRPC server; the parts it serves (fleet, engine, run directory,
events, monitor) are built in ``fedgrid.server.wiring`` and re-exported here where public.
``fedgrid.client.serve`` is the client's twin. (An "app" in fedgrid is the user's code that
``--app`` names, never these modules.)
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedgrid.aggregation import Strategy
from fedgrid.aggregation.lora_ranks import RankPolicy
from fedgrid.allocator import return_large_buffers_to_the_system
from fedgrid.clock import MONOTONIC, Clock
from fedgrid.config import Config
from fedgrid.config_llm import peft_rank_bound
from fedgrid.constants import (
    GIL_SWITCH_INTERVAL_S,
    HEADER_TIMEOUT_S,
    KEEPALIVE_TIME_S,
    KEEPALIVE_TIMEOUT_S,
    MAX_CONNECTION_IDLE_S,
    MAX_MESSAGE_BYTES,
    MAX_STREAMS_PER_CONNECTION,
    MAX_TRANSFERS,
    MAX_TRANSFERS_PER_CLIENT,
    MAX_TRANSFERS_PER_CONNECTION,
    MIN_CLIENT_PING_INTERVAL_S,
    STREAM_IDLE_S,
)
from fedgrid.determinism import intra_op_threads
from fedgrid.errors import ConfigError
from fedgrid.events import Event, EventLog
from fedgrid.interrupts import GracefulStop, say
from fedgrid.pki import RevocationList
from fedgrid.proto.tls import TLSFiles, is_loopback, server_credentials
from fedgrid.server.aio import LoopThread, advertised_address
from fedgrid.server.enrollment import EnrollmentServer
from fedgrid.server.monitor import CoordinatorMonitor
from fedgrid.server.parts import EvaluateFn
from fedgrid.server.peers import PeerCheck
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.service import SERVICE, CoordinatorServicer, add_to_server
from fedgrid.server.status_page import FinalStateHold
from fedgrid.server.wiring import build_fleet, coordinator_model, wire, write_address
from fedgrid.types import ModelState
from fedgrid.webserve import StatusServer

__all__ = [
    "Coordinator",
    "run_coordinator",
    "coordinator_model",
    "build_fleet",
    "rank_policy",
    "write_address",
    "SERVICE_NAME",
]

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
    """A listening gRPC server (``grpc.aio``) over a ``RemoteFleet``; ``port`` is known once constructed.

    The server runs on an asyncio event loop in a thread of its own, so the calling thread
    (the round engine) is free; idle long polls hold no thread.

    Args:
        listen: ``HOST:PORT``; port 0 binds a free port.
        fleet: the fleet the servicer serves.
        max_workers: threads for CPU work (encoding downloads, checking and spilling uploads).
        interceptors: ``grpc.aio`` server interceptors (authentication, logging, fault injection).
        max_transfers: downloads and uploads in flight at once; more get RESOURCE_EXHAUSTED.
        stream_idle_s: an upload stream silent this long is given up (DEADLINE_EXCEEDED).
        header_timeout_s: an upload stream without its header this long after it opened is
            given up (DEADLINE_EXCEEDED).
        max_transfers_per_client, max_transfers_per_connection: each client's and each
            connection's share of ``max_transfers`` (``server/slots.py``).
        tls: the coordinator's CA bundle, certificate and key (and, optionally, revocation
            list): it then speaks only mutual TLS, and a client's identity is its certificate's
            (``server/peers.py``). Without it the coordinator speaks plaintext, which it does
            only on a loopback address or with ``insecure``.
        insecure: allow plaintext on a non-loopback address (logged as a warning).

    Raises:
        ConfigError: plaintext on a non-loopback address without ``insecure``; unreadable
            or mismatched TLS files (named).

    Connection limits (streams per connection, keepalive, idle connections) are the
    ``GRPC_OPTIONS``, from ``fedgrid.constants`` (``FEDGRID_*`` overrides).
    """

    def __init__(
        self,
        listen: str,
        fleet: RemoteFleet,
        *,
        max_workers: int = 256,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        max_transfers: int = MAX_TRANSFERS,
        stream_idle_s: float = STREAM_IDLE_S,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        max_transfers_per_client: int = MAX_TRANSFERS_PER_CLIENT,
        max_transfers_per_connection: int = MAX_TRANSFERS_PER_CONNECTION,
        tls: TLSFiles | None = None,
        insecure: bool = False,
    ) -> None:
        self.fleet = fleet
        host = listen.rpartition(":")[0]
        credentials, check = self._security(host, tls, insecure)
        self.tls = tls is not None
        return_large_buffers_to_the_system()  # model-sized buffers go back to the OS when freed
        # Shorter GIL turns (process-wide, never longer than already set): see GIL_SWITCH_INTERVAL_S.
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self.executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="fedgrid-cpu")
        self._aio = LoopThread("fedgrid-aio")

        async def build() -> tuple[grpc.aio.Server, health_aio.HealthServicer, int]:
            server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=list(interceptors))
            self.servicer = CoordinatorServicer(
                fleet,
                self.executor,
                max_transfers=max_transfers,
                stream_idle_s=stream_idle_s,
                header_timeout_s=header_timeout_s,
                max_transfers_per_client=max_transfers_per_client,
                max_transfers_per_connection=max_transfers_per_connection,
            )
            add_to_server(self.servicer, server, check)
            checker = health_aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(checker, server)
            port = (
                server.add_insecure_port(listen)
                if credentials is None
                else server.add_secure_port(listen, credentials)
            )
            return server, checker, port

        try:
            self.server, self.health, self.port = self._run(build())
        except RuntimeError as exc:  # grpc's "Failed to bind to address": taken, or not this host's
            self._shutdown_loop()
            if "bind" not in str(exc):
                raise
            self.port = 0
        except Exception:
            self._shutdown_loop()
            raise
        if self.port == 0:
            self._shutdown_loop()
            raise OSError(
                f"cannot listen on {listen}: the port is in use (another coordinator?) or the address is "
                "not this host's; pick another with --listen HOST:PORT (port 0: any free one)"
            )
        self.address = advertised_address(listen, self.port)

    @staticmethod
    def _security(
        host: str, tls: TLSFiles | None, insecure: bool
    ) -> tuple[grpc.ServerCredentials | None, PeerCheck]:
        """The server's credentials and per-call check; refuses open plaintext."""
        if tls is not None:
            try:
                credentials = server_credentials(tls)
                revocations = RevocationList(tls.crl, tls.ca) if tls.crl else None
            except (OSError, ValueError) as exc:
                raise ConfigError("cert", str(exc)) from None
            log.info(
                "mutual TLS: clients need a certificate of %s%s",
                tls.ca,
                f", revocations from {tls.crl}" if tls.crl else "",
            )
            return credentials, PeerCheck(tls=True, revocations=revocations)
        if is_loopback(host):
            log.info(
                "plaintext on loopback address %s: for development only (give --ca/--cert/--key to use mTLS)",
                host,
            )
        elif insecure:
            log.warning(
                "INSECURE: plaintext on %s: anyone who reaches the port can join and send updates", host
            )
        else:
            raise ConfigError(
                "listen",
                f"{host!r} is not a loopback address: a coordinator there needs --ca, --cert and --key "
                "(mutual TLS; see `fedgrid certs`), or --insecure to serve plaintext anyway",
            )
        return None, PeerCheck(tls=False)

    def _run(self, coro: Any, timeout: float = 30.0) -> Any:
        return self._aio.run(coro, timeout)

    def _shutdown_loop(self) -> None:
        self._aio.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def start(self) -> "Coordinator":
        self._run(self.server.start())
        self.set_serving(True)
        return self

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )

        async def set_all() -> None:
            for name in ("", SERVICE_NAME):
                await self.health.set(name, status)

        self._run(set_all())

    def stop(self, grace: float = 5.0) -> None:
        """NOT_SERVING, then in-flight RPCs get ``grace`` seconds to finish."""
        if not self._aio.alive:
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
    strategy: Strategy | None = None,
    base_hash: str = "",
    clock: Clock = MONOTONIC,
) -> ModelState | None:
    """Serves ``config.rounds`` rounds and returns the final global model.

    The strategy is ``config.strategy`` (a built-in name, or your own ``MODULE:CLASS``: see
    ``fedgrid.server.strategies``), or ``strategy``, an instance built by the caller, which
    ``config.toml`` then records as its class's ``MODULE:CLASS``; ``config`` may then set none of
    the strategy options (``server_lr``, ...), which would do nothing.

    The initial global model is ``initial``, else ``coordinator_model(config)``: the
    ``initial_model`` safetensors file or the ``MODULE:FACTORY`` of ``model``. This layer
    never imports dataset code; ``fedgrid coordinator`` builds the built-in datasets'
    models and their server-side evaluation (``evaluate_fn``) itself.

    With ``config.state_dir`` it resumes after the last committed round. SIGTERM stops it
    gracefully, and so does SIGINT (Ctrl-C); a second one exits at once (``fedgrid.interrupts``). A stopped
    run returns ``None``; the committed state stays for a restart and the last committed model is
    written to ``RUN_DIR/model.safetensors``.

    The bound address is printed and written to ``RUN_DIR/address`` so that scripts using
    port 0 can find it. With ``config.enroll_listen`` the enrollment service
    (``server/enrollment.py``) runs beside it, its address in ``RUN_DIR/enroll_address``.
    Events (``fedgrid.events``) are appended to ``RUN_DIR/events.jsonl``
    and, with ``on_event``, handed to it on the emitting thread (after the file has them).
    Aggregation runs with ``config.threads`` intra-op threads (restored on return), which
    ``config.toml`` records with the torch version. ``base_hash``: an adapter run's frozen base
    (``--peft``), which every client must show at Join (``BaseModelMismatchError`` otherwise).
    ``clock``: the fleet's time (deadlines, heartbeats' silence, the final state's hold;
    ``fedgrid.clock``: a test passes a ``ManualClock``).
    """
    if strategy is not None:
        config = _with_strategy(config, strategy)
    with intra_op_threads(config.threads) as threads:
        return _serve(config, threads, initial, evaluate_fn, ready, on_event, strategy, base_hash, clock)


def _with_strategy(config: Config, strategy: Strategy) -> Config:
    """``config`` recording ``strategy``'s class as its ``strategy`` key.

    Raises:
        ConfigError: not a ``fedgrid.Strategy``, or ``config`` sets a strategy option, which only
            a strategy built from ``config`` would take.
    """
    if not isinstance(strategy, Strategy):
        raise ConfigError("strategy", f"expected a fedgrid.Strategy, got {type(strategy).__name__}")
    options = config.strategy_options()
    if options:
        key = next(iter(options))
        raise ConfigError(key, "is a strategy option: set it on the strategy given to run_coordinator")
    kind = type(strategy)
    return dataclasses.replace(config, strategy=f"{kind.__module__}:{kind.__qualname__}")


def _stopped_line(config: Config, rounds_done: int, model: Path) -> str:
    """What a stopped coordinator leaves behind, said without claiming durability it lacks."""
    model_text = f"; model of round {rounds_done} in {model}" if rounds_done else ""
    if config.state_dir:
        return f"stopped; state up to round {rounds_done} is committed in {config.state_dir} (a restart resumes there){model_text}"
    return f"stopped after {rounds_done} of {config.rounds} rounds{model_text} (no --state-dir: nothing to resume from)"


def rank_policy(config: Config, lossless_downlink: bool) -> RankPolicy:
    """The LoRA ranks a coordinator (or region) of ``config`` takes at Join: up to its ``peft``'s r,
    others than r under ``lora_aggregation = svd`` on a lossless downlink."""
    return RankPolicy(peft_rank_bound(config.peft), config.lora_aggregation, lossless_downlink)


def _serve(
    config: Config,
    threads: int,
    initial: ModelState | None,
    evaluate_fn: EvaluateFn | None,
    ready: threading.Event | None,
    on_event: Callable[[Event], None] | None,
    strategy: Strategy | None = None,
    base_hash: str = "",
    clock: Clock = MONOTONIC,
) -> ModelState | None:
    wired = wire(config, threads, _initial_model(config, initial), evaluate_fn, on_event, strategy, clock)
    writer, events, fleet, engine = wired.writer, wired.events, wired.fleet, wired.engine
    fleet.base_hash, fleet.lora_ranks = base_hash, rank_policy(config, fleet.downlink.lossless)
    # The checkpoint first: the run id printed, and handed to the first clients, is the restored one.
    engine.resume()
    tls = TLSFiles.from_options(config.ca, config.cert, config.key, config.crl)
    # Bound (and its directory checked) before the coordinator starts: a bad enroll_dir fails first.
    enrollment = (
        EnrollmentServer(config.enroll_listen, ca_dir=config.enroll_dir, tls=tls)
        if config.enroll_listen
        else None
    )
    coordinator, http, hold = _start_servers(config, fleet, wired.monitor, tls, enrollment)
    _announce(config, threads, fleet, events, coordinator, enrollment, http)
    if ready is not None:
        ready.set()
    if http is not None:  # bound and listening since before the coordinator: early requests waited
        http.start()

    def on_term(signal_name: str) -> None:
        # Graceful: report NOT_SERVING, abandon the open round (it is redone on restart),
        # then stop() below lets in-flight RPCs finish within the grace period.
        say(f"{signal_name}: stopping; a second one exits at once")
        log.info("%s: stopping after in-flight requests; the open round is abandoned", signal_name)
        coordinator.set_serving(False)
        engine.stop()
        if hold is not None:
            hold.release()

    with GracefulStop(on_term, what="coordinator"):
        try:
            final = engine.run()
        finally:
            if enrollment is not None:
                enrollment.stop()
            coordinator.stop(grace=5.0)
            fleet.close()
            if http is not None:
                _hold_final_state(hold, http)  # a finished run's watching page reads its last round
                http.stop()
            writer.close()  # the trackers (fedgrid.trackers)
    if final is None:
        print(_stopped_line(config, len(engine.history), writer.dir / "model.safetensors"), flush=True)
        events.emit("stopped", committed=len(engine.history))
        events.close()
        return None
    events.close()
    print(f"run finished: final model in {writer.dir / 'model.safetensors'}", flush=True)
    return final


def _initial_model(config: Config, initial: ModelState | None) -> ModelState:
    """``initial``, else ``coordinator_model(config)``.

    Raises:
        ConfigError: neither (a built-in model, which only ``fedgrid coordinator`` builds).
    """
    if initial is None:
        initial = coordinator_model(config)
    if initial is None:
        raise ConfigError(
            "model",
            f"{config.model or 'the dataset default'!r} is a built-in model: run_coordinator needs initial=..., "
            "--model MODULE:FACTORY or --initial-model FILE.safetensors (the fedgrid coordinator command builds built-in models)",
        )
    return initial


def _hold_final_state(hold: FinalStateHold | None, http: StatusServer) -> None:
    """Serves a finished run's final state until the watching status page has read it
    (``FinalStateHold``): it would otherwise keep the state before the last round."""
    if hold is not None and hold.watched():
        print(
            f"run finished: serving its final state on http://{http.address}/ until the status page "
            f"reads it (at most {hold.limit_s:g} s, http_linger_s)",
            flush=True,
        )
        hold.wait()


def _start_servers(
    config: Config,
    fleet: RemoteFleet,
    monitor: CoordinatorMonitor | None,
    tls: TLSFiles | None,
    enrollment: EnrollmentServer | None,
) -> tuple[Coordinator, StatusServer | None, FinalStateHold | None]:
    """Binds the status server (with a monitor, its routes wrapped by the hold of the final
    state), starts the coordinator, then the enrollment service; what was bound is stopped
    again when a later step fails."""
    http: StatusServer | None = None
    hold: FinalStateHold | None = None
    try:
        # Bound first: a refused --http (no token off loopback, port taken) fails before any client can join.
        if monitor is not None:
            hold = FinalStateHold(
                lambda: monitor.state == "finished", limit_s=config.http_linger_s, clock=fleet.clock
            )
            http = StatusServer(config.http, hold.routes(monitor.routes()), token_file=config.http_token_file)
        interceptors = [monitor.interceptor()] if monitor is not None else []
        coordinator = Coordinator(
            config.listen,
            fleet,
            max_workers=config.max_workers,
            tls=tls,
            insecure=config.insecure,
            interceptors=interceptors,
        ).start()
        if enrollment is not None:
            enrollment.start()
    except BaseException:
        if enrollment is not None:
            enrollment.stop(grace=0)
        if http is not None:
            http.stop()
        raise
    return coordinator, http, hold


def _announce(
    config: Config,
    threads: int,
    fleet: RemoteFleet,
    events: EventLog,
    coordinator: Coordinator,
    enrollment: EnrollmentServer | None,
    http: StatusServer | None,
) -> None:
    """Writes the bound addresses to ``RUN_DIR`` and prints them; emits ``started``."""
    if http is not None:
        write_address(Path(config.out) / "http_address", http.address)
        print(
            f"fedgrid status on http://{http.address}/ (/metrics, /api/status{'; bearer token required' if http.authenticated else ''})",
            flush=True,
        )
    if enrollment is not None:  # first: a script that sees RUN_DIR/address finds this one too
        write_address(Path(config.out) / "enroll_address", enrollment.address)
        print(
            f"fedgrid enrollment service listening on {enrollment.address} (certificates of {config.enroll_dir})",
            flush=True,
        )
    write_address(Path(config.out) / "address", coordinator.address)
    print(
        f"fedgrid coordinator listening on {coordinator.address} (run {fleet.run_id}, dir {config.out}, {threads} threads)",
        flush=True,
    )
    events.emit("started", run_id=fleet.run_id, address=coordinator.address, threads=threads)
