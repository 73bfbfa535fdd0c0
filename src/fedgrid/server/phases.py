"""One phase of a round on a ``RemoteFleet``: fit, evaluate or a message phase.

A phase is a ``RoundTask`` (``server/rounds.py``) with a deterministic id, opened to its
clients, waited on until it closes (its target reached, the rest failed or silent, or the
deadline passed), then turned into a ``RoundOutcome``. The phases differ in what a client
downloads (a fit phase the downlink's model, an evaluation the exact global model, a message
phase nothing) and in how the outcome is typed. A collaborator of ``RemoteFleet``, sharing its
lock and wake-ups (the membership's).
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import timedelta
from typing import Callable, Mapping, Sequence

from fedgrid.events import EventLog
from fedgrid.fleet import protocol
from fedgrid.fleet.base import Quorum, RoundOutcome
from fedgrid.fleet.codec_policy import CodecPolicy
from fedgrid.fleet.downlink import Downlink, RoundDownlink
from fedgrid.proto import serde
from fedgrid.proto.buffers import receive_buffers
from fedgrid.server.disk import StorageGuard
from fedgrid.server.membership import Membership
from fedgrid.server.messages import Mailbox
from fedgrid.server.rounds import RoundTask, wait_for_close
from fedgrid.server.spill import UpdateSpill
from fedgrid.textsafe import escape
from fedgrid.types import (
    EVALUATE,
    FIT,
    ClientInfo,
    EvaluateIns,
    EvaluateRes,
    Failure,
    FitIns,
    FitRes,
    MessageIns,
    MessageRes,
    ModelState,
    TensorSpec,
    check_phase_name,
)

__all__ = ["Phases"]

log = logging.getLogger(__name__)


class Phases:
    """Runs the phases of a fleet's rounds.

    Args:
        membership: the fleet's clients (its lock and wake-ups are the fleet's).
        spill: where accepted updates wait; those that landed before a restart are not asked for again.
        mailbox: relays a message phase's messages once it closed.
        downlink: what a fit phase's clients download.
        codec_policy: each client's uplink codec, sent with its fit task.
        events: where phases opening and closing are reported.
        open_round: makes a task the fleet's open round (called with the lock held).
        run_id: the fleet's run id (part of every task id).
        task_scope: the fleet's task scope (part of every task id).
        interrupted: whether the coordinator is stopping.
        heartbeat_interval_s: the clients' heartbeat interval; silence is checked twice per interval.
        storage: the fleet's storage failure, raised once a phase closes (``server/disk.py``).
    """

    def __init__(
        self,
        membership: Membership,
        *,
        spill: UpdateSpill,
        mailbox: Mailbox,
        downlink: Downlink,
        codec_policy: CodecPolicy,
        events: EventLog,
        open_round: Callable[[RoundTask], None],
        run_id: Callable[[], str],
        task_scope: Callable[[], str],
        interrupted: Callable[[], bool],
        heartbeat_interval_s: float,
        storage: StorageGuard | None = None,
    ) -> None:
        self.membership = membership
        self.lock, self.wake = membership.lock, membership.wake
        self._buffers = receive_buffers()  # the pool this process's uploads are received into
        self.spill = spill
        self.mailbox = mailbox
        self.downlink = downlink
        self.codec_policy = codec_policy
        self.events = events
        self._open_round = open_round
        self._run_id = run_id
        self._task_scope = task_scope
        self._interrupted = interrupted
        self.heartbeat_interval_s = heartbeat_interval_s
        self.storage = storage if storage is not None else StorageGuard(lambda: None)

    def hand_over(self, rnd: RoundTask | None, joined: ClientInfo) -> None:
        """A client that joined again while its earlier session's task is open takes that task
        (``RoundTask.hand_over``; lock held): a region or client restarted mid-round rejoins
        its round instead of skipping it."""
        old = rnd.hand_over(joined) if rnd is not None else None
        if rnd is None or old is None:
            return
        self.wake.notify("round", ("poll", joined.client_id))
        log.info(
            "round %d: %s rejoined: its open task goes to the new session %s",
            rnd.server_round,
            escape(joined.name),
            joined.client_id,
        )
        self.events.emit(
            "task_handed_over",
            round=rnd.server_round,
            client=joined.client_id,
            previous=old,
            name=joined.name,
        )

    def fit(
        self,
        *,
        server_round: int,
        global_state: ModelState,
        assignments: Sequence[tuple[ClientInfo, FitIns]],
        timeout: timedelta,
        target: int | None = None,
        quorum: Quorum | None = None,
    ) -> RoundOutcome[FitRes]:
        """A fit phase: clients download the downlink's model and upload their updates; it closes
        once ``target`` (default: all) reported, the rest failed, or the deadline passed.
        Under a ``quorum``: once ``quorum.min_quorum`` reported and ``quorum.grace_s`` passed
        (or all reported), the clients still pending keep their task (``RoundOutcome.waiting``)."""
        tasks = {info.client_id: protocol.fit_task(self.codec_policy, info, ins) for info, ins in assignments}
        rnd = self._new_task(
            server_round,
            FIT,
            [(info, tasks[info.client_id][0]) for info, _ in assignments],
            timeout,
            downlink=self.downlink.prepare(global_state),
            expected=TensorSpec.of(global_state),
        )
        rnd.codecs.update((cid, codec) for cid, (_, codec) in tasks.items())
        # Updates that landed before a restart are not asked for again.
        rnd.results.update(
            self.spill.restore(
                task_id=rnd.task_id, assigned={info.client_id: info for info, _ in assignments}
            )
        )
        if rnd.results:
            log.info("round %d: %d updates restored from before a restart", server_round, len(rnd.results))
            self.events.emit("updates_restored", round=server_round, count=len(rnd.results))
        results, failures, cancelled = self._run(rnd, timeout, target=target, quorum=quorum)
        return RoundOutcome(
            [r for r in results if isinstance(r, FitRes)],
            failures,
            cancelled,
            bytes_up=rnd.bytes_up,
            bytes_down=rnd.bytes_down,
            extra=rnd.tally.extra(),
            closed_by=rnd.closed_by,
            waiting=[rnd.clients[cid] for cid in rnd.assignments if cid in rnd.carried],
        )

    def evaluate(
        self,
        *,
        server_round: int,
        global_state: ModelState,
        assignments: Sequence[tuple[ClientInfo, EvaluateIns]],
        timeout: timedelta,
    ) -> RoundOutcome[EvaluateRes]:
        """An evaluation phase: clients download the exact global model and report their metrics."""
        # Evaluation judges the exact global model, whatever the downlink policy.
        downlink = RoundDownlink(base=global_state, version=0, _full=serde.EncodedModel(global_state))
        rnd = self._new_task(
            server_round,
            EVALUATE,
            assignments,
            timeout,
            downlink=downlink,
            expected=TensorSpec.of(global_state),
        )
        results, failures, cancelled = self._run(rnd, timeout)
        return RoundOutcome(
            [r for r in results if isinstance(r, EvaluateRes)],
            failures,
            cancelled,
            bytes_up=rnd.bytes_up,
            bytes_down=rnd.bytes_down,
            closed_by=rnd.closed_by,
        )

    def message(
        self,
        *,
        server_round: int,
        phase: str,
        assignments: Sequence[tuple[ClientInfo, MessageIns]],
        timeout: timedelta,
    ) -> RoundOutcome[MessageRes]:
        """Message phase ``phase``: clients poll a ``MESSAGE`` task and send their messages; once
        it closed, the mailbox relays them."""
        if check_phase_name(phase) in (FIT, EVALUATE):
            raise ValueError(f"{phase!r} is a model phase, not a message phase")
        rnd = self._new_task(
            server_round,
            phase,
            [(info, dataclasses.replace(ins, client_id=info.client_id)) for info, ins in assignments],
            timeout,
        )
        results, failures, cancelled = self._run(rnd, timeout)
        self.mailbox.relay(rnd)
        return RoundOutcome(
            [r for r in results if isinstance(r, MessageRes)],
            failures,
            cancelled,
            bytes_up=rnd.bytes_up,
            bytes_down=rnd.bytes_down,
            closed_by=rnd.closed_by,
        )

    def _new_task(
        self,
        server_round: int,
        kind: str,
        assignments: Sequence[tuple[ClientInfo, FitIns | EvaluateIns | MessageIns]],
        timeout: timedelta,
        *,
        downlink: RoundDownlink | None = None,
        expected: Mapping[str, TensorSpec] | None = None,
    ) -> RoundTask:
        # Deterministic: a round redone after a restart has the same task id, so a client's
        # retried upload of that round (same seed, same bits) is accepted.
        scope = self._task_scope()
        scope = scope + "-" if scope else ""
        suffix = kind if kind in (FIT, EVALUATE) else f"msg-{kind}"
        return RoundTask(
            server_round=server_round,
            task_id=f"{self._run_id()[:12]}-{scope}r{server_round}-{suffix}",
            kind=kind,
            assignments={info.client_id: ins for info, ins in assignments},
            clients={info.client_id: info for info, _ in assignments},
            deadline=self.wake.clock.now() + timeout.total_seconds(),
            downlink=downlink,
            expected=dict(expected or {}),
        )

    def _run(
        self, rnd: RoundTask, timeout: timedelta, *, target: int | None = None, quorum: Quorum | None = None
    ) -> tuple[list[FitRes | EvaluateRes | MessageRes], list[Failure], list[ClientInfo]]:
        """Opens ``rnd`` for its clients and closes it when ``target`` (default: all)
        reported, the rest failed or went silent, or the deadline passed; under a ``quorum``,
        when its quorum reported and its grace passed."""
        opened = {"task": rnd.task_id, "clients": len(rnd.assignments), "evaluate": rnd.evaluate}
        self.events.emit("round_opened", round=rnd.server_round, phase=rnd.kind, **opened)
        with self.lock:
            self._open_round(rnd)
            self.wake.notify(*(("poll", cid) for cid in rnd.assignments))  # only the clients with a task
            goal = len(rnd.assignments) if target is None else min(target, len(rnd.assignments))
            if quorum is not None:
                goal = min(quorum.min_quorum, len(rnd.assignments))
            reason = wait_for_close(
                rnd,
                goal=goal,
                membership=self.membership,
                wake=self.wake,
                interrupted=self._interrupted,
                check_every_s=self.heartbeat_interval_s / 2,
                timeout_s=timeout.total_seconds(),
                grace_s=None if quorum is None else quorum.grace_s,
            )
            closed_at = self.wake.clock.now()
            results, failures, cancelled = rnd.close(reason)
            reason = rnd.closed_by
            waiting = [cid for cid in rnd.assignments if cid in rnd.carried]
        self.storage.check()  # the disk refused an update: the coordinator stops, nothing is aggregated
        self.spill.flush()  # write-backs under way land, and fsyncs, before the strategy sees them (server/spill.py)
        # Receive buffers not in use go back to the system before the strategy aggregates:
        # the pool speeds up the uploads of a round, it must not add to aggregation's memory.
        self._buffers.clear()
        quorum_fields: dict[str, object] = {}
        if quorum is not None and rnd.quorum_at is not None:
            # Semi-asynchronous: how long it stayed open after its quorum, and whom it did not wait for.
            quorum_fields = {"after_quorum_s": round(closed_at - rnd.quorum_at, 6), "waiting": waiting}
        if waiting:
            log.info(
                "round %d: closed at its quorum of %d without waiting for %s",
                rnd.server_round,
                goal,
                ", ".join(escape(rnd.clients[cid].name or cid) for cid in waiting),
            )
        self.events.emit(
            "round_closed",
            round=rnd.server_round,
            evaluate=rnd.evaluate,
            phase=rnd.kind,
            reason=reason,
            results=len(results),
            failures=len(failures),
            **quorum_fields,
        )
        return results, failures, cancelled
