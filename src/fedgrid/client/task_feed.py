"""The client's side of a run's tasks, without the training: ``TaskFeed`` joins, long-polls and
runs message phases, and hands out each fit or evaluate task as a downloaded ``TaskStep`` to
deliver or fail; ``TaskReport`` and ``ClientEvent`` tell an observer what happened.

``fedgrid.client.runtime.run_client`` trains on every step; an embedding
``fedgrid.client.session.Session`` hands the steps to its host program.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import grpc

from fedgrid.client.api import Client
from fedgrid.client.connection import MAX_REJOINS, Connection
from fedgrid.client.rpc import IdentityConflict, RpcFailed
from fedgrid.client.timeline import COMM, SPLIT_KEYS, Timeline
from fedgrid.config_compression import task_uplink_codec
from fedgrid.constants import POLL_WAIT_S
from fedgrid.errors import InvalidUpdateError
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import serde
from fedgrid.types import EVALUATE, FIT, FitIns, ModelState, Scalar

__all__ = ["TaskReport", "ClientEvent", "TaskStep", "TaskFeed"]

# The runtime's logger: these records have always come from it.
log = logging.getLogger("fedgrid.client.runtime")


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


#: What ``ReportFailure`` may meet after a refusal that leaves nothing to report: the round
#: closed, the session ended, or the task is no longer this client's.
_GONE = (
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.INVALID_ARGUMENT,
)


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
        timeline: where the download (here) and the upload (``deliver``) are recorded as
            ``COMM`` (the client's ``timeline``; a fresh one when none is given).
    """

    def __init__(self, conn: Connection, task: pb.Task, *, timeline: Timeline | None = None) -> None:
        self.conn = conn
        self.timeline = Timeline() if timeline is None else timeline
        self.task_id, self.round, self.deadline_s = task.task_id, int(task.round), float(task.deadline_s)
        self.kind = EVALUATE if task.kind == pb.EVALUATE else FIT
        self._down_before, self._up_before = conn.bytes_down, conn.bytes_up
        self.started = time.monotonic()
        with self.timeline.span(COMM):
            self.state: ModelState = (
                conn.download(task.task_id) if self.kind == EVALUATE else conn.fetch_model(task.task_id)
            )
        self.config: dict[str, Scalar] = serde.config_from_pb(task.config)
        self.ins: FitIns | None = serde.fit_ins_from_task(task) if self.kind == FIT else None
        #: Why the coordinator refused the latest ``deliver`` as late ("" if it did not).
        self.late = ""
        #: Why the coordinator refused the latest ``deliver``'s update itself, INVALID_ARGUMENT
        #: (over a bound, malformed; "" if it did not): the round's failure, not the client's end.
        self.refused = ""

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

    def _report_refusal(self) -> None:
        """Tells the round the refused update is this client's failure: otherwise its task stays
        open, and the next poll would hand the same task back."""
        try:
            self.fail(f"update refused: {self.refused}")
        except RpcFailed as exc:
            if exc.code not in _GONE:
                raise
            log.info("round %d: the refusal was not reported (%s)", self.round, exc.details)

    def _undelivered(self, exc: RpcFailed) -> None:
        """Sets ``late`` or ``refused`` for an upload that did not land, or re-raises ``exc``."""
        if exc.code == grpc.StatusCode.UNAUTHENTICATED and not isinstance(exc, IdentityConflict):
            # The coordinator dropped the session meanwhile (it heard nothing from it for too
            # long, or restarted without it): this update is lost, and the next poll joins again.
            log.warning(
                "round %d: the coordinator no longer knows this session (%s): the update is lost",
                self.round,
                exc.details,
            )
            self.late = exc.details or "the session ended"
            return
        if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
            log.warning(
                "round %d: the coordinator refused the update (%s): this round failed, the next goes on",
                self.round,
                exc.details,
            )
            self.refused = exc.details or "the update was refused"
            self._report_refusal()
            return
        if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
            raise exc
        log.warning("round %d closed before the update landed: %s", self.round, exc.details)
        self.late = exc.details or "the round closed"

    def deliver(
        self,
        update: ModelState,
        num_examples: int,
        metrics: Mapping[str, float],
        *,
        on_encoded: Callable[[], None] | None = None,
    ) -> TaskReport | None:
        """Uploads the result through the task's ``uplink_codec`` (error feedback kept in the
        connection). Returns what it cost, or ``None`` when the round closed before the update
        landed (``late`` says why) or the coordinator refused it (``refused`` says why).
        A refused update is this round's failure: the client goes on to its next task.
        ``on_encoded``: ``Connection.upload``'s (the client's state is saved there).

        Raises:
            RpcFailed: any other refusal, or transient failures past the retry budget.
        """
        metrics, codec = dict(metrics), task_uplink_codec(self.config)
        self.late = self.refused = ""
        try:
            with self.timeline.span(COMM):
                self.conn.upload(
                    self.task_id,
                    self.round,
                    update,
                    num_examples,
                    metrics,
                    codec=codec,
                    global_state=self.state,
                    task_config=self.config,
                    on_encoded=on_encoded,
                )
        except RpcFailed as exc:
            self._undelivered(exc)
            return None
        loss = metrics.get("loss", metrics.get("train_loss"))
        if self.kind == FIT:
            log.info(
                "round %d: trained on %d examples in %s, loss %s",
                self.round,
                num_examples,
                describe_split(metrics, time.monotonic() - self.started),
                "-" if loss is None else f"{loss:.4f}",
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
    coordinator no longer knows the session (at most ``MAX_REJOINS`` times in a row; never
    when another process of the same identity replaced it: ``IdentityConflict``), runs
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
                if isinstance(exc, IdentityConflict):  # joining again would replace the other process
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
            try:
                step = TaskStep(conn, reply.task, timeline=self.client.timeline)
            except RpcFailed as exc:
                if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                # The task closed before its model came (the coordinator or region restarted and
                # runs its round again, or the round reached its target): the next poll has the next.
                log.warning("round %d: task gone before its download: %s", reply.task.round, exc.details)
                continue
            yield step


def describe_split(metrics: Mapping[str, float], task_s: float) -> str:
    """The log's words for a fit result's split (``fedgrid.client.timeline``): ``33.5 s: compute
    5.5 s, comm 27.6 s, wait 0.4 s (utilization 0.16)``; without the split in ``metrics``, the
    task's own ``task_s`` seconds."""
    if not all(key in metrics for key in SPLIT_KEYS):
        return f"{task_s:.1f} s"
    return (
        f"{metrics['wall_s']:.1f} s: compute {metrics['compute_s']:.1f} s, comm {metrics['comm_s']:.1f} s, "
        f"wait {metrics['wait_s']:.1f} s (utilization {metrics['utilization']:.2f})"
    )


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
