"""The client's gRPC runtime: join, long-poll for tasks, download, train, upload.

The calls are ``Connection``'s (``fedgrid.client.connection``: deadlines, retries with
backoff, mutual TLS). ``run`` blocks; ``start`` runs the same loop in a background thread.

With a ``state_path``, what the client keeps across rounds (the uplink's error-feedback
residuals, the ``Client``'s own ``state_dict``) is written there after every fit task,
atomically, and restored when a client of the same name rejoins the same run, so a restarted
client process carries on where it stopped.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import grpc

from fedgrid.client.api import Client

# Connection lives in client/connection.py and its errors in client/rpc.py; the SDK's users import them from here.
from fedgrid.client.connection import MAX_REJOINS, Connection, _Heartbeat
from fedgrid.client.rpc import GRPC_OPTIONS, TRANSIENT, CoordinatorUnreachable, RpcFailed, check_target
from fedgrid.client.state import load_client_state, restore_client_state, save_client_state
from fedgrid.constants import POLL_WAIT_S
from fedgrid.errors import InvalidUpdateError
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import serde
from fedgrid.proto.tls import TLSFiles
from fedgrid.types import EVALUATE, FIT, FitIns, ModelState, Scalar

__all__ = [
    "Connection",
    "ClientHandle",
    "RunSummary",
    "TaskReport",
    "ClientEvent",
    "TaskStep",
    "TaskFeed",
    "RpcFailed",
    "CoordinatorUnreachable",
    "run_client",
    "start_client",
    "TRANSIENT",
    "GRPC_OPTIONS",
    "check_target",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskReport:
    """One task the client finished and uploaded, for an observer (``run``'s ``on_task``).

    Attributes:
        round: the coordinator's round.
        kind: ``fit`` or ``evaluate``.
        num_examples: examples the result claims.
        loss: the result's ``loss`` or ``train_loss`` metric, if it has one.
        bytes_up: wire bytes (``serde.wire_size``, as the coordinator counts them) sent for
            the upload, every try included.
        bytes_down: wire bytes received for the task's model download.
        upload_retries: tries of the upload after the first.
    """

    round: int
    kind: str
    num_examples: int
    loss: float | None
    bytes_up: int
    bytes_down: int
    upload_retries: int


@dataclass(frozen=True)
class ClientEvent:
    """A change of the client's session, for an observer (``run``'s ``on_event``).

    Attributes:
        kind: ``joined`` (``client_id``, ``run_id``; again after a refused session),
            ``polling`` (waiting for a task), ``task`` (``round``, ``task``: ``fit``,
            ``evaluate`` or ``message``), ``error`` (``round``, ``detail``: the task failed or
            its round closed first; the client goes on), ``finished`` (the run ended) or
            ``left`` (``detail``: why this client stopped).
    """

    kind: str
    round: int = 0
    task: str = ""
    client_id: str = ""
    run_id: str = ""
    detail: str = ""


@dataclass(frozen=True)
class RunSummary:
    """What ``run`` returns: rounds trained and the client's id."""

    client_id: str
    rounds: int


class TaskStep:
    """One fit or evaluate task, its model downloaded (by ``TaskFeed``): the caller trains or
    evaluates, then ``deliver``s the result or ``fail``s the task. What ``run`` does with every
    task and what a ``fedgrid.client.session.Session`` hands its host program.

    Attributes:
        task_id, round, deadline_s: the coordinator's task id, round and seconds for the task.
        kind: ``fedgrid.types.FIT`` or ``EVALUATE``.
        state: the global model. Lossy uplinks send the difference to it, and a compressed
            downlink applies the next round's difference to it: never change it in place.
        config: the task's scalars; ``ins``: a fit task's ``FitIns`` (``None`` for an evaluation).
    """

    def __init__(self, conn: Connection, task: pb.Task) -> None:
        self.conn = conn
        self.task_id, self.round, self.deadline_s = task.task_id, int(task.round), float(task.deadline_s)
        self.kind = EVALUATE if task.kind == pb.EVALUATE else FIT
        self._down_before, self._up_before = conn.bytes_down, conn.bytes_up
        self.started = time.monotonic()
        self.state: ModelState = (
            conn.download(task.task_id) if self.kind == EVALUATE else conn.fetch_model(task.task_id)
        )
        self.config: dict[str, Scalar] = serde.config_from_pb(task.config)
        self.ins: FitIns | None = serde.fit_ins_from_task(task) if self.kind == FIT else None
        #: Why the coordinator refused the latest ``deliver`` as late ("" if it did not).
        self.late = ""

    @staticmethod
    def check(update: ModelState, metrics: Mapping[str, float]) -> None:
        """Refuses a diverged fit result before it goes out (the coordinator would refuse it).

        Raises:
            InvalidUpdateError: naming the first tensor or metric that is not finite.
        """
        serde.check_finite(update)
        bad = [k for k, v in metrics.items() if not math.isfinite(v)]
        if bad:
            raise InvalidUpdateError(f"metric {bad[0]!r} is {metrics[bad[0]]}")

    def fail(self, reason: str) -> None:
        """Reports the task failed with ``reason``: the round records it at once."""
        self.conn.report_failure(self.task_id, reason)

    def deliver(
        self, update: ModelState, num_examples: int, metrics: Mapping[str, float]
    ) -> TaskReport | None:
        """Uploads the result through the task's ``uplink_codec`` (error feedback kept in the
        connection). Returns what it cost, or ``None`` (``late`` says why) when the round
        closed before the update landed.

        Raises:
            RpcFailed: any other refusal, or transient failures past the retry budget.
        """
        metrics, self.late, codec = dict(metrics), "", str(self.config.get("uplink_codec", "none"))
        try:
            self.conn.upload(
                self.task_id, self.round, update, num_examples, metrics, codec=codec, global_state=self.state
            )
        except RpcFailed as exc:
            if exc.code == grpc.StatusCode.UNAUTHENTICATED:
                # The coordinator dropped the session meanwhile (it heard nothing from it for too
                # long, or restarted without it): this update is lost, and the next poll joins again.
                log.warning(
                    "round %d: the coordinator no longer knows this session (%s): the update is lost",
                    self.round,
                    exc.details,
                )
                self.late = exc.details or "the session ended"
                return None
            if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.warning("round %d closed before the update landed: %s", self.round, exc.details)
            self.late = exc.details or "the round closed"
            return None
        loss = metrics.get("loss", metrics.get("train_loss"))
        if self.kind == FIT:
            log.info(
                "round %d: trained on %d examples, loss %s, %.2fs",
                self.round,
                num_examples,
                "-" if loss is None else f"{loss:.4f}",
                time.monotonic() - self.started,
            )
        return TaskReport(
            round=self.round,
            kind=self.kind,
            num_examples=num_examples,
            loss=None if loss is None else float(loss),
            bytes_up=self.conn.bytes_up - self._up_before,
            bytes_down=self.conn.bytes_down - self._down_before,
            upload_retries=max(0, len(self.conn.upload_attempts) - 1),
        )


class TaskFeed:
    """``run``'s loop without the training: joins, long-polls, joins again when the
    coordinator no longer knows the session (at most ``MAX_REJOINS`` times in a row), runs
    message phases through ``client.exchange``/``receive``, and yields every fit or evaluate
    task as a downloaded ``TaskStep``, until the run finishes or ``conn.stop`` is set.

    ``client`` is what Join says (name, region, examples) and who takes part in message
    phases. ``finished``: the coordinator said the run is over (no Leave is owed). ``lock`` is
    held across every Join: a thread that sets ``conn.stop`` and leaves under it is sure that
    no Join follows its Leave.
    """

    def __init__(
        self,
        conn: Connection,
        client: Client,
        *,
        poll_wait_s: float = POLL_WAIT_S,
        on_event: Callable[[ClientEvent], None] | None = None,
    ) -> None:
        self.conn, self.client, self.poll_wait_s = conn, client, poll_wait_s
        self.on_event = on_event
        self.finished = False
        self.lock = threading.Lock()

    def emit(self, kind: str, **fields: Any) -> None:
        """Tells ``on_event`` of a change of the session (``ClientEvent``)."""
        if self.on_event is not None:
            self.on_event(ClientEvent(kind=kind, **fields))

    def join(self) -> bool:
        """Joins (again); returns ``False`` without joining once ``conn.stop`` is set."""
        with self.lock:
            if self.conn.stop.is_set():
                return False
            self.conn.join(self.client)
        self.emit("joined", client_id=self.conn.client_id, run_id=self.conn.run_id)
        return True

    def __iter__(self) -> Iterator[TaskStep]:
        conn, rejoins = self.conn, 0
        while not conn.stop.is_set():
            try:
                self.emit("polling")
                reply = conn.poll(self.poll_wait_s)
            except RpcFailed as exc:
                rejoins += 1
                if exc.code != grpc.StatusCode.UNAUTHENTICATED or rejoins > MAX_REJOINS:
                    raise
                if conn.stop.is_set():  # it left meanwhile (a Leave from another thread): nothing to rejoin
                    return
                # The coordinator no longer knows this session (it restarted without our
                # registration): join again and carry on.
                log.warning("session refused (%s): joining again", exc.details)
                run_id = conn.run_id
                if not self.join():
                    return
                if conn.run_id != run_id:  # a new run: residuals of the old model mean nothing
                    log.warning(
                        "the coordinator now runs %s (was %s): uplink state reset", conn.run_id, run_id
                    )
                    conn.load_uplink_state_dict({})
                continue
            rejoins = 0
            kind = reply.WhichOneof("reply")
            if kind == "finished":
                self.finished = True
                return
            if kind != "task":
                continue
            self.emit(
                "task",
                round=reply.task.round,
                task={pb.MESSAGE: "message", pb.EVALUATE: EVALUATE}.get(reply.task.kind, FIT),
            )
            if reply.task.kind == pb.MESSAGE:
                _exchange(conn, self.client, reply.task)
                continue
            yield TaskStep(conn, reply.task)


def run_client(
    client: Client,
    coordinator: str,
    *,
    stop: threading.Event | None = None,
    poll_wait_s: float = POLL_WAIT_S,
    state_path: str | os.PathLike[str] | None = None,
    ca: str = "",
    cert: str = "",
    key: str = "",
    server_name: str = "",
    on_task: Callable[[TaskReport], None] | None = None,
    on_event: Callable[[ClientEvent], None] | None = None,
    **connection_options: float,
) -> RunSummary:
    """Joins ``coordinator`` and serves tasks until the run finishes or ``stop`` is set.

    Args:
        client: the application's client.
        coordinator: ``HOST:PORT``.
        stop: set it to leave the loop after the current call.
        poll_wait_s: longest long poll.
        state_path: where the client's state across rounds is saved after every fit task and
            restored from at start, when the file is this client's (same ``name``) and from
            the run the coordinator serves; any other file is logged and ignored (see
            ``load_client_state``). ``None``: kept in memory only.
        ca, cert, key: PEM files for mutual TLS (all three or none): the CA bundle that signs
            the coordinator's certificate, this client's certificate and its key. The client
            is then the identity of its certificate, which also names its state file's owner.
        server_name: the name the coordinator's certificate holds, when not the host of
            ``coordinator``.
        on_task: called with a ``TaskReport`` after each fit or evaluate task whose upload
            landed (``fedgrid client --http`` counts them as metrics).
        on_event: called with a ``ClientEvent`` at each change of the session (``fedgrid
            client --http`` serves the latest as ``/api/status``).
        connection_options: passed to ``Connection`` (``connect_timeout``, ``rpc_timeout``, ...).

    Raises:
        CoordinatorUnreachable: no answer from ``coordinator`` within ``connect_timeout``
            (a ``connection_options`` key; default ``CONNECT_TIMEOUT_S``).
        RpcFailed: a non-transient error, or transient ones past the retry budget.
        ValueError: an incomplete or unreadable set of TLS files (named), or a
            ``coordinator`` that is not ``HOST:PORT``.
    """
    stop = stop or threading.Event()
    tls = TLSFiles.from_options(ca, cert, key, what="client TLS")
    conn = Connection(coordinator, stop=stop, tls=tls, server_name=server_name, **connection_options)
    saved = (
        load_client_state(state_path, name=conn.identity or client.name) if state_path is not None else None
    )
    beat_stop = threading.Event()
    feed = TaskFeed(conn, client, poll_wait_s=poll_wait_s, on_event=on_event)
    heartbeat: _Heartbeat | None = None
    leaving = "stopped"
    try:
        heartbeat = _open(feed, coordinator, saved, state_path, beat_stop)
        rounds = _serve(feed, state_path, on_task)
    except BaseException as exc:  # KeyboardInterrupt and SystemExit included: the client is going
        leaving = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise
    finally:
        _close(feed, leaving, beat_stop, heartbeat)
    return RunSummary(client_id=conn.client_id, rounds=rounds)


def _open(
    feed: TaskFeed,
    coordinator: str,
    saved: Mapping[str, Any] | None,
    state_path: str | os.PathLike[str] | None,
    beat_stop: threading.Event,
) -> _Heartbeat:
    """``run``'s start: joins, restores the client's saved state, starts the heartbeat."""
    conn, client = feed.conn, feed.client
    feed.join()
    log.info("joined %s as %s (run %s)", coordinator, conn.client_id, conn.run_id)
    if saved is not None and state_path is not None:
        restore_client_state(conn, client, saved, state_path)
    heartbeat = _Heartbeat(conn, beat_stop)
    heartbeat.start()
    return heartbeat


def _serve(
    feed: TaskFeed, state_path: str | os.PathLike[str] | None, on_task: Callable[[TaskReport], None] | None
) -> int:
    """``run``'s loop: trains or evaluates every task of ``feed`` and uploads the result;
    returns the fit rounds whose update landed."""
    conn, client, rounds = feed.conn, feed.client, 0
    for step in feed:
        try:
            if step.kind == EVALUATE:
                update, num_examples, metrics = _evaluate(client, step.state, step.config)
            else:
                assert step.ins is not None
                out = client.fit(step.state, step.ins)
                update, num_examples, metrics = out.state, out.num_examples, dict(out.metrics)
                # Diverged training (NaN or Inf) is the round's failure, not the client's end.
                step.check(update, metrics)
        except Exception as exc:  # the application's code failed: the round hears it now, the client goes on
            log.exception("round %d: %s failed", step.round, step.kind)
            step.fail(f"{type(exc).__name__}: {exc}")
            feed.emit("error", round=step.round, detail=f"{type(exc).__name__}: {exc}")
            continue
        report = step.deliver(update, num_examples, metrics)
        _save(state_path, conn, client, step)  # a late update too: the residuals moved on all the same
        if report is None:
            feed.emit("error", round=step.round, detail="the round closed before the update landed")
            continue
        if step.kind == FIT:
            rounds += 1
        if on_task is not None:
            on_task(report)
    return rounds


def _close(feed: TaskFeed, leaving: str, beat_stop: threading.Event, heartbeat: _Heartbeat | None) -> None:
    """``run``'s end, however it ends: tells the coordinator the client leaves (unless the run
    finished), stops the heartbeat and closes the connection."""
    conn = feed.conn
    feed.emit("finished") if feed.finished else feed.emit("left", detail=leaving)
    if conn.client_id and not feed.finished:  # joined, and the run did not end: say so, not just go silent
        conn.leave(leaving)
    beat_stop.set()
    if heartbeat is not None:
        # A heartbeat in flight when the process exits can abort grpc's C++ core
        # ("terminate called without an active exception"): let it finish first.
        heartbeat.join(timeout=conn.rpc_timeout + 1.0)
    conn.close()


def _exchange(conn: Connection, client: Client, task: pb.Task) -> None:
    """A message phase: the client's messages go out, the ones relayed to it come back."""
    ins = serde.message_ins_from_task(task, conn.client_id)
    try:
        outbox = client.exchange(ins)
    except Exception as exc:  # the application's code failed: the phase hears it now
        log.exception("round %d: message phase %s failed", task.round, task.phase)
        conn.report_failure(task.task_id, f"{type(exc).__name__}: {exc}")
        return
    try:
        conn.send_messages(task.task_id, outbox)
        inbox = conn.receive_messages(task.task_id, deadline_s=task.deadline_s + conn.rpc_timeout)
    except RpcFailed as exc:
        if exc.code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
            raise
        log.warning("round %d: message phase %s: %s", task.round, task.phase, exc.details)
        return
    except (TimeoutError, InterruptedError) as exc:
        log.warning("round %d: message phase %s: %s", task.round, task.phase, exc)
        return
    try:
        client.receive(ins, inbox)
    except Exception:  # its next task will tell
        log.exception("round %d: receiving message phase %s failed", task.round, task.phase)


def _save(path: str | os.PathLike[str] | None, conn: Connection, client: Client, step: TaskStep) -> None:
    if path is None or step.kind == EVALUATE:
        return
    try:
        save_client_state(path, run_id=conn.run_id, server_round=step.round, client=client, conn=conn)
    except OSError as exc:  # training goes on; the next round tries again
        log.error("could not save client state to %s: %s", path, exc)


def _evaluate(client: Client, state: ModelState, config: dict) -> tuple[ModelState, int, dict[str, float]]:
    """Runs ``client.evaluate``; a client without evaluation reports zero examples."""
    try:
        out = client.evaluate(state, config)
    except NotImplementedError as exc:
        log.info("evaluation task skipped: %s", exc)
        return OrderedDict(), 0, {}
    return OrderedDict(), out.num_examples, dict(out.metrics)


class ClientHandle:
    """A client running in a background thread (see ``start``)."""

    def __init__(self, thread: threading.Thread, stop: threading.Event) -> None:
        self._thread, self._stop = thread, stop
        self.summary: RunSummary | None = None
        self.error: BaseException | None = None

    def stop(self) -> None:
        """Asks the loop to leave after its current call."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> RunSummary:
        """Waits for the loop to end; re-raises its error.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"client still running after {timeout}s")
        if self.error is not None:
            raise self.error
        assert self.summary is not None
        return self.summary

    @property
    def running(self) -> bool:
        return self._thread.is_alive()


def start_client(
    client: Client, coordinator: str, *, state_path: str | os.PathLike[str] | None = None, **options: Any
) -> ClientHandle:
    """Runs ``run_client(client, coordinator, state_path=..., **options)`` in a daemon thread of the
    host program (``options``: ``ca``, ``cert``, ``key``, ``server_name`` and ``Connection``'s)."""
    stop = threading.Event()
    handle: ClientHandle

    def target() -> None:
        try:
            handle.summary = run_client(client, coordinator, stop=stop, state_path=state_path, **options)
        except BaseException as exc:  # handed to join()
            handle.error = exc

    thread = threading.Thread(target=target, name=f"fedgrid-client-{client.name}", daemon=True)
    handle = ClientHandle(thread, stop)
    thread.start()
    return handle


#: ``run`` and ``start`` started a client without saying so; for one release, with a warning.
_RENAMED = {"run": "run_client", "start": "start_client"}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        import warnings

        warnings.warn(
            f"fedgrid.client.runtime.{name} is deprecated and goes in the next release: use "
            f"fedgrid.client.runtime.{_RENAMED[name]}",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
