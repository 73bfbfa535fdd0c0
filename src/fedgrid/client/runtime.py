"""The client's gRPC runtime: join, long-poll for tasks, download, train, upload.

The calls are ``Connection``'s (``fedgrid.client.connection``: deadlines, retries with
backoff, mutual TLS). ``run_client`` blocks; ``start_client`` runs the same loop in a background thread.

With a ``state_path``, what the client keeps across rounds (the uplink's error-feedback
residuals, the ``Client``'s own ``state_dict``) is written there after every fit task,
atomically, and restored when a client of the same name rejoins the same run, so a restarted
client process carries on where it stopped.

Every fit result's metrics carry where the worker's time went (``fedgrid.client.timeline``):
the runtime records each fit and evaluation as ``COMPUTE`` and each download and upload as
``COMM`` on ``client.timeline``, and adds the split of the window from the end of the previous
fit (or the client's start) to the end of this one (``SPLIT_KEYS``: ``compute_s``, ``comm_s``,
``wait_s``, ``wall_s``, ``transfer_s``, ``utilization``). The windows tile the worker's life,
so the sums over its tasks are its totals.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from fedgrid.client.api import Client

# Connection lives in client/connection.py and its errors in client/rpc.py; the SDK's users import them from here.
from fedgrid.client.connection import Connection
from fedgrid.client.heartbeat import Heartbeat
from fedgrid.client.rpc import (
    GRPC_OPTIONS,
    TRANSIENT,
    CoordinatorLost,
    CoordinatorUnreachable,
    IdentityConflict,
    MisconfiguredConnection,
    RpcFailed,
    check_target,
)
from fedgrid.client.state import load_client_state, restore_client_state, save_client_state

# The task feed lives in client/task_feed.py; the SDK's users import its types from here.
from fedgrid.client.task_feed import ClientEvent, TaskFeed, TaskReport, TaskStep
from fedgrid.client.timeline import COMPUTE, with_split
from fedgrid.constants import POLL_WAIT_S
from fedgrid.proto.tls import TLSFiles
from fedgrid.types import EVALUATE, FIT, ModelState

__all__ = [
    "Connection",
    "ClientHandle",
    "RunSummary",
    "TaskReport",
    "ClientEvent",
    "TaskStep",
    "TaskFeed",
    "StateSaver",
    "RpcFailed",
    "CoordinatorUnreachable",
    "MisconfiguredConnection",
    "CoordinatorLost",
    "IdentityConflict",
    "run_client",
    "start_client",
    "TRANSIENT",
    "GRPC_OPTIONS",
    "check_target",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSummary:
    """What ``run`` returns: rounds trained and the client's id."""

    client_id: str
    rounds: int


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
        MisconfiguredConnection: a connection that can never succeed as configured (a TLS
            certificate without the name dialled, of another CA, expired...), at once.
        CoordinatorLost: the coordinator stopped answering for ``retry_max_elapsed`` seconds.
        IdentityConflict: another process joined under this client's identity.
        RpcFailed: any other non-transient error.
        ValueError: an incomplete or unreadable set of TLS files (named), or a
            ``coordinator`` that is not ``HOST:PORT``.
    """
    stop = stop or threading.Event()
    started = client.timeline.clock()  # the first fit's window opens here
    tls = TLSFiles.from_options(ca, cert, key, what="client TLS")
    conn = Connection(coordinator, stop=stop, tls=tls, server_name=server_name, **connection_options)
    saved = None if state_path is None else load_client_state(state_path, name=conn.identity or client.name)
    feed = TaskFeed(conn, client, poll_wait_s=poll_wait_s, on_event=on_event)
    rounds = _join_serve_leave(feed, coordinator, saved, state_path, on_task, since=started)
    return RunSummary(client_id=conn.client_id, rounds=rounds)


def _join_serve_leave(
    feed: TaskFeed,
    coordinator: str,
    saved: Mapping[str, Any] | None,
    state_path: str | os.PathLike[str] | None,
    on_task: Callable[[TaskReport], None] | None,
    *,
    since: float,
) -> int:
    """``run``'s session: ``_open``, ``_serve`` (returns the fit rounds whose update landed),
    and ``_close`` however it ends, with what ended it as the reason the client leaves."""
    heartbeat: Heartbeat | None = None
    leaving: str | None = "stopped"
    try:
        heartbeat = _open(feed, coordinator, saved, state_path)
        return _serve(feed, state_path, on_task, since=since)
    except IdentityConflict:  # the session is another process's now: no Leave of ours may end it
        leaving = None
        raise
    except BaseException as exc:  # KeyboardInterrupt and SystemExit included: the client is going
        leaving = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise
    finally:
        _close(feed, leaving, heartbeat)


def _open(
    feed: TaskFeed,
    coordinator: str,
    saved: Mapping[str, Any] | None,
    state_path: str | os.PathLike[str] | None,
) -> Heartbeat:
    """``run``'s start: joins, restores the client's saved state, starts the heartbeat."""
    conn, client = feed.conn, feed.client
    feed.join()
    # Plaintext is named: a client on loopback joins whichever coordinator holds the port.
    log.info(
        "joined %s as %s (run %s%s)",
        coordinator,
        conn.client_id,
        conn.run_id,
        "" if conn.tls else ", plaintext",
    )
    if saved is not None and state_path is not None:
        restore_client_state(conn, client, saved, state_path)
    heartbeat = Heartbeat(conn, threading.Event(), client.progress)
    heartbeat.start()
    return heartbeat


def _serve(
    feed: TaskFeed,
    state_path: str | os.PathLike[str] | None,
    on_task: Callable[[TaskReport], None] | None,
    *,
    since: float,
) -> int:
    """``run``'s loop: trains or evaluates every task of ``feed`` and uploads the result;
    returns the fit rounds whose update landed. A fit result's metrics gain the split of the
    window from ``since`` (``client.timeline.clock``'s time), then from the previous fit's end,
    to the end of this fit (module docstring)."""
    conn, client, rounds = feed.conn, feed.client, 0
    timeline = client.timeline
    saver = StateSaver(state_path, conn, client)
    try:
        for step in feed:
            saver.wait()  # the previous task's state is written before the client is used again
            try:
                if step.kind == EVALUATE:
                    with timeline.span(COMPUTE):
                        update, num_examples, metrics = _evaluate(client, step.state, step.config)
                else:
                    assert step.ins is not None
                    with timeline.span(COMPUTE):
                        out = client.fit(step.state, step.ins)
                    end = timeline.clock()
                    split, since = timeline.split(since, end), end
                    update, num_examples = out.state, out.num_examples
                    metrics = with_split(out.metrics, split)
                    # Diverged training (NaN or Inf) is the round's failure, not the client's end.
                    step.check(update, metrics)
            except (
                Exception
            ) as exc:  # the application's code failed: the round hears it now, the client goes on
                log.exception("round %d: %s failed", step.round, step.kind)
                step.fail(f"{type(exc).__name__}: {exc}")
                feed.emit("error", round=step.round, detail=f"{type(exc).__name__}: {exc}")
                continue
            report = step.deliver(update, num_examples, metrics)
            saver.save(step)  # a late update too: the residuals moved on all the same
            if report is None:
                detail = (
                    f"update refused: {step.refused}"
                    if step.refused
                    else "the round closed before the update landed"
                )
                feed.emit("error", round=step.round, detail=detail)
                continue
            if step.kind == FIT:
                rounds += 1
            if on_task is not None:
                on_task(report)
    finally:
        saver.wait()  # the last state is on disk before the run ends
    return rounds


def _close(feed: TaskFeed, leaving: str | None, heartbeat: Heartbeat | None) -> None:
    """``run``'s end, however it ends: tells the coordinator the client leaves (unless the run
    finished, or ``leaving`` is ``None``: the session was replaced), stops the heartbeat and
    closes the connection."""
    conn = feed.conn
    feed.emit("finished") if feed.finished else feed.emit("left", detail=leaving or "session replaced")
    if conn.client_id and not feed.finished and leaving is not None:  # joined, the run did not end: say so
        conn.leave(leaving)
    if heartbeat is not None:
        heartbeat.stop.set()
        # A heartbeat in flight when the process exits can abort grpc's C++ core
        # ("terminate called without an active exception"): let it finish first.
        heartbeat.join(timeout=conn.rpc_timeout + 1.0)
    conn.close()


class StateSaver:
    """Writes the client's state file (``--state-dir``) after each fit task.

    A client still training after its upload (overlapped DiLoCo's steps after the send,
    ``TorchClient.lookahead_running``) is saved once those steps end, the only state in which
    its model and optimizer agree: the write waits for them in a thread of its own, so the poll
    and download of the next task go on meanwhile rather than after them. The uplink's
    error-feedback state is taken when the upload ends, as before. ``wait`` comes before the
    next use of the client (a fit or evaluation) and before the run ends, so one write at a
    time and none beside training.
    """

    def __init__(self, path: str | os.PathLike[str] | None, conn: Connection, client: Client) -> None:
        self.path, self.conn, self.client = path, conn, client
        self._thread: threading.Thread | None = None

    def save(self, step: TaskStep) -> None:
        if self.path is None or step.kind == EVALUATE:
            return
        self.wait()
        snapshot = {
            "run_id": self.conn.run_id,
            "server_round": step.round,
            "name": self.conn.name,
            "uplink": self.conn.uplink_state_dict(),
        }
        if not getattr(self.client, "lookahead_running", False):
            self._write(snapshot)
            return
        self._thread = threading.Thread(
            target=self._write, args=(snapshot,), name="fedgrid-state-save", daemon=True
        )
        self._thread.start()

    def _write(self, snapshot: dict[str, Any]) -> None:
        assert self.path is not None
        try:
            save_client_state(self.path, client=self.client, **snapshot)
        except OSError as exc:  # training goes on; the next round tries again
            log.error("could not save client state to %s: %s", self.path, exc)

    def wait(self) -> None:
        """Returns once no write is under way."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None


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
