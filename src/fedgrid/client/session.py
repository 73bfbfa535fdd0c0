"""An embedding session: the federation as an iterator inside a program that owns its loop.

``run`` calls the application (``Client.fit``); a session turns that around for a program
that already has its own training loop: the program asks for the next task, trains however
it likes, and hands the result back::

    with fedgrid.client.connect("coord.example.org:50051", name="site-a", num_examples=len(data)) as session:
        for task in session.tasks():
            model.load_state_dict(task.state)          # the round's global model
            loss = train_for_a_while(model)            # the program's own loop
            session.submit(FitOutput(model.state_dict(), num_examples=len(data), metrics={"loss": loss}))

Overlapped syncs (DiLoCo's ``sync_delay_steps``, tau): ``submit_nowait`` hands the result
over and returns at once; the upload, then the poll and download of the next task, run in
the background while the program trains its tau steps; at its merge step it waits on the
handle (which counts the seconds it blocked), and the next ``tasks()`` item is already there::

    for task in session.tasks():
        merge_and_train(model, task.state, steps=inner_steps - tau)
        sync = session.submit_nowait(FitOutput(model.state_dict(), num_examples=n))
        train(model, steps=tau)                     # while the network works
        sync.wait(timeout=600)                      # blocks only if the sync is late

``aconnect`` is the same for asyncio (``async with`` / ``async for`` / ``await``): its
blocking gRPC calls run in a worker thread of the session, so the event loop never blocks.

A session is ``run``'s machinery with the training left out: the same ``Connection``
(deadlines, retries, mutual TLS), ``TaskFeed`` (long polls, a new Join when the coordinator
forgot the session, message phases) and ``TaskStep`` (the finite check, the upload through
the task's ``uplink_codec`` with error feedback, the ``TaskReport``), and its heartbeat.
Leaving the ``with`` for whatever reason (its end, an exception, Ctrl-C) sends Leave (unless
the run finished), stops the heartbeat and closes the channel; no Join ever follows the
Leave, so the coordinator holds no half-open registration.

A fit result goes up with the split of the host's time (``fedgrid.client.timeline``) from the
previous fit's ``submit`` (or the session's ``open``) to this one: downloads and uploads are
communication; the host's training counts as compute only where the host says so, inside
``with session.compute():``; the rest is waiting.

Its parts: ``Session`` and ``connect`` here; the ``Task`` and the hooks a host passes in
``fedgrid.client.session_host``; ``submit_nowait``'s ``Delivery`` in ``fedgrid.client.delivery``;
``AsyncSession`` (``aconnect``) in ``fedgrid.client.async_session``. All are importable from here.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Iterator

import grpc

from fedgrid.client.api import EvaluateOutput, FitOutput
from fedgrid.client.async_session import AsyncSession
from fedgrid.client.delivery import Delivery
from fedgrid.client.heartbeat import Heartbeat
from fedgrid.client.runtime import Connection, RpcFailed, StateSaver, TaskFeed, TaskReport, TaskStep
from fedgrid.client.session_host import (
    ErrorHook,
    MessageHandler,
    SessionMember,
    SessionOptions,
    Task,
    task_line,
    tell,
)
from fedgrid.client.state import load_client_state, restore_client_state
from fedgrid.client.timeline import COMPUTE, Timeline, with_split
from fedgrid.errors import InvalidUpdateError, SessionError, StaleTaskError
from fedgrid.proto.tls import TLSFiles
from fedgrid.types import EVALUATE, FIT, EvaluateIns, FitIns, ModelState

__all__ = [
    "Task",
    "Session",
    "SessionOptions",
    "Delivery",
    "AsyncSession",
    "MessageHandler",
    "ErrorHook",
    "connect",
    "aconnect",
]

log = logging.getLogger(__name__)


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class Session:
    """A client of ``coordinator`` whose host program trains: see the module's docstring.

    Made by ``connect``; entering it (or ``open``) joins, leaving it (or ``close``) leaves.

    Args:
        coordinator: ``HOST:PORT``.
        options: who the client is, its TLS files and its hooks (``SessionOptions``).

    Raises:
        ValueError: an incomplete or unreadable set of TLS files, or a ``coordinator`` that
            is not ``HOST:PORT``.
    """

    def __init__(self, coordinator: str, options: SessionOptions = SessionOptions()) -> None:
        o = options
        tls = TLSFiles.from_options(o.ca, o.cert, o.key, what="session TLS")
        self.conn = Connection(
            coordinator, stop=threading.Event(), tls=tls, server_name=o.server_name, **o.connection
        )
        self._member = SessionMember(
            o.name, o.region, o.num_examples, o.messages, base_hash=o.base_hash, lora_rank=o.lora_rank
        )
        self._feed = TaskFeed(self.conn, self._member, poll_wait_s=o.poll_wait_s)
        self._evaluate, self._state_path = o.evaluate, o.state_path
        self._on_task, self._on_error, self._verbose = o.on_task, o.on_error, o.verbose
        self._beat_stop = threading.Event()
        self._heartbeat: Heartbeat | None = None
        self._lock = threading.Lock()  # guards the open task and the closing
        self._open: tuple[TaskStep, Task] | None = None
        #: ``submit_nowait``'s delivery and the next step it fetched (``tasks()`` takes it).
        self._pending: Delivery | None = None
        self._prefetched: TaskStep | None = None
        self._steps: Iterator[TaskStep] | None = None
        self._joined = self._closed = False
        self._since = self.timeline.clock()  # the first fit's window opens here (again at open())
        #: Fit results that landed.
        self.rounds = 0
        #: The reason sent with Leave, and whether the coordinator heard it (``None``: no
        #: Leave was sent: never joined, or the run finished).
        self.left: str | None = None
        self.leave_heard = False

    @property
    def client_id(self) -> str:
        """The coordinator's id of this client ("" before it joined)."""
        return self.conn.client_id

    @property
    def run_id(self) -> str:
        return self.conn.run_id

    @property
    def finished(self) -> bool:
        """The coordinator said the run is over (``tasks()`` ended for that reason)."""
        return self._feed.finished

    @property
    def timeline(self) -> Timeline:
        """The session's compute and transfer intervals (``fedgrid.client.timeline``)."""
        return self._member.timeline

    def compute(self) -> AbstractContextManager[None]:
        """Records the time the ``with`` block takes as the host's compute::

            for task in session.tasks():
                with session.compute():
                    loss = train_for_a_while(model)
                session.submit(FitOutput(...))

        A fit result's ``compute_s`` (and ``utilization``) counts only such time; the host's
        time outside it and outside the session's transfers is ``wait_s``. Any thread may use
        it (a host training in the background).
        """
        return self.timeline.span(COMPUTE)

    def open(self) -> "Session":
        """Joins the coordinator and starts the heartbeat.

        Raises:
            CoordinatorUnreachable: no answer within ``connect_timeout``.
            RpcFailed: the Join was refused.
            SessionError: the session was already opened or closed.
        """
        with self._lock:
            if self._joined or self._closed:
                raise SessionError("a session opens once: connect() again for a new one")
            self._joined = True
        self._since = self.timeline.clock()
        name = self.conn.identity or self._member.name
        saved = load_client_state(self._state_path, name=name) if self._state_path is not None else None
        try:
            if not self._feed.join():
                raise SessionError("the session was closed while it joined")
            if self._verbose:
                plain = "" if self.conn.tls else ", plaintext"
                tell(f"joined {self.conn.target} as {self.conn.client_id} (run {self.conn.run_id}{plain})")
            if saved is not None and self._state_path is not None:
                restore_client_state(self.conn, self._member, saved, self._state_path)
            self._heartbeat = Heartbeat(self.conn, self._beat_stop)
            self._heartbeat.start()
        except BaseException as exc:
            self.close(_reason(exc))
            raise
        return self

    def __enter__(self) -> "Session":
        return self.open()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc is not None:
                with self._lock:
                    task = self._open[1] if self._open is not None else None
                self._error(exc, task)
        finally:
            self.close("the host program closed the session" if exc is None else _reason(exc))

    def tasks(self) -> Iterator[Task]:
        """The tasks the coordinator sends, each with its model downloaded, until the run
        finishes or the session closes. Answer each with ``submit`` or ``report_failure``; one
        left unanswered when the next is asked for is reported failed at once.

        Raises:
            SessionError: the session is not open.
            RpcFailed: a non-transient error, or transient ones past the retry budget.
        """
        if not self._joined or self._closed:
            raise SessionError("tasks() needs an open session: use `with connect(...) as session:`")
        self._steps = iter(self._feed)
        while True:
            pending, self._pending = self._pending, None
            if pending is not None:  # submit_nowait fetched it
                pending.wait()
                step, self._prefetched = self._prefetched, None
            else:
                step = self._next_step()
            if step is None:
                return
            task = self._task(step)
            with self._lock:
                self._open = (step, task)
            yield task
            with self._lock:
                unanswered, self._open = self._open is not None and self._open[0] is step, None
            if unanswered:
                reason = f"the host program asked for the next task without answering round {step.round}'s {step.kind} task"
                self._fail(step, task, reason)
                self._error(SessionError(reason), task)

    def submit(self, result: FitOutput | EvaluateOutput) -> TaskReport | None:
        """Answers the open task: a ``FitOutput`` (state, examples, metrics) for a fit task,
        an ``EvaluateOutput`` for an evaluation. A fit result's metrics gain the split of the
        host's time since the previous fit's ``submit`` (module docstring). Returns the
        upload's ``TaskReport``, or ``None`` when it did not land (``on_error`` says why): a
        fit result with NaN or Inf is refused here and reported as the round's failure, the
        coordinator may refuse the update (over a bound: the round's failure, the session goes
        on), and a round may close first.

        Raises:
            SessionError: no task is open.
            TypeError: the wrong kind of result for the task (the task stays open).
            ValueError: a fit result claiming more examples than ``num_examples`` (it stays open).
            RpcFailed: transient failures past the retry budget, or another refusal.
        """
        step, task = self._take("submit", result)
        metrics = dict(result.metrics)
        update: ModelState = OrderedDict()
        if isinstance(result, FitOutput):
            update = result.state
            end = self.timeline.clock()
            metrics = with_split(metrics, self.timeline.split(self._since, end))
            self._since = end
            try:
                step.check(update, metrics)
            except InvalidUpdateError as exc:
                self._fail(step, task, _reason(exc))
                self._error(exc, task)
                return None
        return self._deliver(step, task, update, result.num_examples, metrics)

    def submit_nowait(self, result: FitOutput) -> Delivery:
        """Answers the open fit task as ``submit`` does, without waiting: the upload, then the
        poll and download of the next task, run in the background (the module docstring).
        ``tasks()`` yields that next task once it is there, and re-raises what failed.

        Raises:
            SessionError: no task is open, or a delivery is still on its way.
            TypeError, ValueError: as ``submit`` (the task stays open).
        """
        if self._pending is not None:
            raise SessionError(
                "submit_nowait(): the previous result is still on its way; take the next task first"
            )
        step, task = self._take("submit_nowait", result)
        metrics, refused = dict(result.metrics), False
        try:
            step.check(result.state, metrics)
        except InvalidUpdateError as exc:
            self._fail(step, task, _reason(exc))
            self._error(exc, task)
            refused = True

        def work() -> TaskReport | None:
            report = (
                None if refused else self._deliver(step, task, result.state, result.num_examples, metrics)
            )
            self._prefetched = self._next_step()
            delivery.next_round = None if self._prefetched is None else self._prefetched.round
            return report

        delivery = self._pending = Delivery(work)
        return delivery

    def report_failure(self, reason: str | BaseException) -> None:
        """Answers the open task with a failure: the round records ``reason`` at once (an
        exception is named by its type and message) instead of waiting out its deadline.

        Raises:
            SessionError: no task is open.
            RpcFailed: the report was refused (other than for a round that closed first).
        """
        step, task = self._take("report_failure")
        self._fail(step, task, reason if isinstance(reason, str) else _reason(reason))

    def close(self, reason: str = "the host program closed the session") -> None:
        """Leaves (unless the run finished), stops the heartbeat and closes the channel.
        Idempotent, and callable from any thread: a ``tasks()`` waiting in another thread
        ends (the Leave wakes its long poll)."""
        with self._lock:
            if self._closed:
                return
            self._closed, self._open = True, None
        with self._feed.lock:  # no Join after this Leave
            self.conn.stop.set()
            if self.conn.client_id and not self._feed.finished:
                self.left, self.leave_heard = reason, self.conn.leave(reason)
        self._beat_stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=self.conn.rpc_timeout + 1.0)  # not mid-call when the channel closes
        self.conn.close()

    # -- inside ----------------------------------------------------------------------------
    @staticmethod
    def _task(step: TaskStep) -> Task:
        ins: FitIns | EvaluateIns = (
            step.ins if step.ins is not None else EvaluateIns(round=step.round, config=step.config)
        )
        return Task(
            round=step.round,
            kind=step.kind,
            state=step.state,
            config=step.config,
            ins=ins,
            deadline_s=step.deadline_s,
            task_id=step.task_id,
        )

    def _next_step(self) -> TaskStep | None:
        """The next task the host takes (evaluations answered here when it does not), ``None``
        once the run finished or the session closed."""
        assert self._steps is not None
        while True:
            try:
                step = next(self._steps, None)
            except RpcFailed:
                if self._closed:  # close() from another thread cut the call short
                    return None
                raise
            if step is None or step.kind != EVALUATE or self._evaluate:
                return step
            self._deliver(step, self._task(step), OrderedDict(), 0, {})

    def _take(self, what: str, result: object = None) -> tuple[TaskStep, Task]:
        with self._lock:
            if self._open is None:
                state = "the session is closed" if self._closed else "take one from session.tasks() first"
                raise SessionError(f"{what}(): no task is open ({state})")
            step, task = self._open
            if result is not None:
                expected = FitOutput if step.kind == FIT else EvaluateOutput
                if not isinstance(result, expected):
                    raise TypeError(
                        f"round {step.round}'s {step.kind} task takes a {expected.__name__}, got {type(result).__name__}"
                    )
                # The coordinator would refuse such an update (the round's failure): say so here, at once.
                claimed, joined = getattr(result, "num_examples", 0), self._member.num_examples
                if step.kind == FIT and claimed > joined:
                    raise ValueError(
                        f"round {step.round}'s result claims {claimed} examples, the session reported {joined} at join "
                        "(connect(..., num_examples=N) bounds what an update may claim)"
                    )
            self._open = None
            return step, task

    def _fail(self, step: TaskStep, task: Task, reason: str) -> None:
        try:
            step.fail(reason)
        except RpcFailed as exc:
            if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.info(
                "round %d closed before its failure was reported: %s", step.round, exc.details
            )  # nothing left to fail

    def _deliver(
        self, step: TaskStep, task: Task, update: ModelState, num_examples: int, metrics: dict[str, float]
    ) -> TaskReport | None:
        # Saved once encoded, before it is sent (a late update too: the residuals moved on), as
        # run_client saves. The host trains itself: nothing runs in the background here.
        saver = StateSaver(self._state_path, self.conn, self._member)
        report = step.deliver(update, num_examples, metrics, on_encoded=lambda: saver.save(step))
        if report is None:
            self._error(
                InvalidUpdateError(f"round {step.round}'s {step.kind} result was refused: {step.refused}")
                if step.refused
                else StaleTaskError(
                    f"round {step.round} closed before the {step.kind} result landed: {step.late}"
                ),
                task,
            )
            return None
        if step.kind == FIT:
            self.rounds += 1
        if self._verbose:
            tell(task_line(report))
        if self._on_task is not None:
            self._on_task(report)
        return report

    def _error(self, error: BaseException, task: Task | None) -> None:
        if self._on_error is None:
            return
        try:
            self._on_error(error=error, task=task)
        except Exception:  # a broken hook must not keep the session from answering or leaving
            log.exception("the session's on_error hook failed")


def connect(coordinator: str, **options: Any) -> Session:
    """A session with ``coordinator`` for a program that owns its training loop; ``with``
    joins and leaves. ``options`` are ``SessionOptions``'s fields (``name``, ``num_examples``,
    ``ca``, ``cert``, ``key``, ``on_task``, ``on_error``, ...); the others are ``Connection``'s
    (``connect_timeout``, ``rpc_timeout``, ...).

    Raises:
        ValueError: bad TLS files or a ``coordinator`` that is not ``HOST:PORT``.
    """
    return Session(coordinator, SessionOptions.of(**options))


def aconnect(coordinator: str, **options: Any) -> AsyncSession:
    """``connect`` for asyncio: ``async with aconnect(...) as session: async for task in
    session.tasks(): ... await session.submit(...)``.

    Raises:
        ValueError: bad TLS files or a ``coordinator`` that is not ``HOST:PORT``.
    """
    return AsyncSession(Session(coordinator, SessionOptions.of(**options)))
