"""``RemoteFleet``: the coordinator's side of the protocol, as plain Python: the fleet of clients
that are elsewhere (it imports no grpc; the servicer in ``server/service.py`` is the gRPC edge).

It answers the handlers the servicer calls (join, poll, download, upload, messages,
heartbeat, failure reports, leave) and runs each phase of a round until it closes. The
parts live beside it, each a collaborator sharing the fleet's lock: the client membership
(``server/membership.py``), long polls (``server/polls.py``), downloads
(``server/downloads.py``), uploads (``server/uploads.py``, accepting through
``fleet/protocol.py``), failure reports and leaves (``server/departures.py``), message phases
(``server/messages.py``), running a phase from opening to outcome (``server/phases.py``), the
open task, its closing and the relay rules (``server/rounds.py``), the tasks a quorum's round
carries and their late results (``server/late_results.py``), spill and downlink. It raises
``FedgridError`` subclasses; the servicer maps them to status codes. Every request is
validated before it touches state.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from datetime import timedelta
from typing import Any, Iterable, Iterator, Mapping, Sequence

from fedgrid.aggregation.lora_ranks import RankPolicy
from fedgrid.aggregation.selection import CapabilityFilter
from fedgrid.clock import MONOTONIC, Clock
from fedgrid.compression.spec import CodecSpec
from fedgrid.constants import (
    CHUNK_SIZE,
    HEARTBEAT_INTERVAL_S,
    MAX_POLLS_PER_CLIENT,
    RETRY_MAX_WAIT_S,
    WAITING_REPORT_S,
)
from fedgrid.errors import InterruptedRunError, RunFinishedError, StaleTaskError
from fedgrid.events import EventLog
from fedgrid.fleet.base import Fleet, Quorum, RoundOutcome
from fedgrid.fleet.bounds import UpdateBounds
from fedgrid.fleet.codec_policy import CodecPolicy
from fedgrid.fleet.downlink import Downlink
from fedgrid.release import VERSION
from fedgrid.server.departures import Departures
from fedgrid.server.disk import StorageGuard
from fedgrid.server.downloads import Downloads
from fedgrid.server.late_results import CarriedTasks
from fedgrid.server.membership import SILENCE_INTERVALS, ClientRecord, Membership
from fedgrid.server.messages import InboxPage, Mailbox
from fedgrid.server.phases import Phases
from fedgrid.server.polls import PollResult, Polls
from fedgrid.server.progress import check_progress
from fedgrid.server.rounds import RoundTask
from fedgrid.server.spill import UpdateSpill
from fedgrid.server.uploads import Uploads
from fedgrid.server.wakeups import Wakeups
from fedgrid.textsafe import escape
from fedgrid.types import (
    ClientInfo,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    MessageIns,
    MessageRes,
    ModelState,
)

__all__ = ["RemoteFleet", "PollResult", "SILENCE_INTERVALS"]

log = logging.getLogger(__name__)

#: After a restart, restored clients have the retry backoff cap plus this long to reconnect.
RESTART_GRACE_S = 10.0


class RemoteFleet(Fleet):
    """Clients reached over gRPC; they pull their tasks.

    Args:
        heartbeat_interval: how often clients report; silence for ``SILENCE_INTERVALS``
            of these drops a client from the round and the membership.
        chunk_size: payload bytes per chunk of model downloads.
        spill_dir: where accepted updates wait for aggregation (see ``server/spill.py``);
            under the state directory they survive a crash. Default: a temporary directory.
        codec_policy: the uplink codec of each client (sent with its task).
        downlink_codec: ``none`` (every client downloads the exact global model, or the
            part of it its task names in ``FitIns.download``) or a lossy spec: clients get
            the compressed change since the version they hold, with server-side error
            feedback (see ``fleet/downlink.py``), whatever ``FitIns.download`` says.
        events: where the fleet reports joins, drops, accepted uploads and round closes
            (``fedgrid.events``); default: nowhere.
        max_polls_per_client: long polls one client may hold at once; more raise
            ``ResourceLimitError`` (RESOURCE_EXHAUSTED).
        task_scope: part of every task id, so that nested rounds (a global round made of
            regional rounds, each regional round numbered from 1) never share a task id.
        bounds: what a Join may report and an update may claim and change (``fleet/bounds.py``).
        requirements: the capabilities a client must report to take tasks (``require_device``
            and the other keys; ``None``: any client). The others stay registered and
            heartbeat, but ``wait_for_clients`` neither counts nor returns them.
        clock: the time of deadlines, grace windows, silence and waits (``fedgrid.clock``; a
            test passes a ``ManualClock`` and advances it instead of sleeping).
    """

    def __init__(
        self,
        *,
        heartbeat_interval: timedelta = timedelta(seconds=HEARTBEAT_INTERVAL_S),
        chunk_size: int = CHUNK_SIZE,
        spill_dir: str | os.PathLike[str] | None = None,
        codec_policy: CodecPolicy | None = None,
        downlink_codec: CodecSpec = CodecSpec.NONE,
        events: EventLog | None = None,
        max_polls_per_client: int = MAX_POLLS_PER_CLIENT,
        task_scope: str = "",
        bounds: UpdateBounds | None = None,
        requirements: CapabilityFilter | None = None,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.run_id = uuid.uuid4().hex
        self.requirements = requirements
        self.bounds = bounds if bounds is not None else UpdateBounds()
        self.events = events if events is not None else EventLog()
        self.max_polls_per_client = max_polls_per_client
        self.task_scope = task_scope
        self.codec_policy = codec_policy or CodecPolicy()
        self.downlink = Downlink(downlink_codec)
        self.spill = UpdateSpill(spill_dir, clock=clock)
        self.heartbeat_interval_s = heartbeat_interval.total_seconds()
        self.chunk_size = chunk_size
        #: The frozen base model's hash of an adapter run (``--peft``): a Join must show the same ("": none).
        self.base_hash = ""
        #: The release a Join must show (its ``fedgrid_version``; "": a client from before the field).
        self.fedgrid_version = VERSION
        self.lora_ranks = RankPolicy()  # the LoRA ranks a Join may announce (fedgrid.aggregation.lora_ranks)
        self._round: RoundTask | None = None
        self._finished = False
        self._interrupted = False
        self.storage = StorageGuard(self.interrupt)  # the disk refusing an update stops the fleet
        self._lock = threading.RLock()
        self.clock = clock
        self._wake = Wakeups(self._lock, clock=clock)  # keyed: a task wakes its client's poll only
        self._build_parts()

    def _build_parts(self) -> None:
        """The collaborators: each shares the fleet's lock and wake-ups (the membership's) and reads
        the fleet's changing state (open round, run id, flags) through callables."""
        self.membership = Membership(
            self._wake, self.events, self.heartbeat_interval_s, self._fail_removed, self.bounds
        )
        # Semi-asynchronous rounds: fit tasks closed at their quorum with clients still on them.
        self.carried = CarriedTasks(self.membership, self.spill, self.events)
        self.departures = Departures(self.membership, self.events, self._open_task)
        self.uploads = Uploads(
            self.membership,
            self.spill,
            self.events,
            self._open_task,
            lambda: self._round,
            bounds=self.bounds,
            run_id=lambda: self.run_id,
            late_refusal=self.carried.refusal,
        )
        self.mailbox = Mailbox(
            self.membership, self.events, self._open_task, lambda: self._round, lambda: self._interrupted
        )
        self.downloads = Downloads(
            self.membership,
            self.downlink,
            self._open_task,
            run_id=lambda: self.run_id,
            chunk_size=lambda: self.chunk_size,
        )
        self.phases = Phases(
            self.membership,
            spill=self.spill,
            mailbox=self.mailbox,
            downlink=self.downlink,
            codec_policy=self.codec_policy,
            events=self.events,
            open_round=self._open_round,
            run_id=lambda: self.run_id,
            task_scope=lambda: self.task_scope,
            interrupted=lambda: self._interrupted,
            heartbeat_interval_s=self.heartbeat_interval_s,
            storage=self.storage,
        )
        self.polls = Polls(
            self.membership,
            lambda: self._round,
            finished=lambda: self._finished,
            interrupted=lambda: self._interrupted,
            max_polls=lambda: self.max_polls_per_client,
        )

    # -- handlers (called by the servicer) -------------------------------------------------
    def join(self, joining: ClientInfo, *, identity: str | None = None) -> tuple[ClientInfo, str]:
        """Registers a client (its ``client_id`` is assigned here); returns its info and session
        token. ``identity``: its certificate's, under mTLS (``Membership.join``)."""
        if self._finished:
            raise RunFinishedError("the run is over")
        with self._lock:  # one step: the open round never sees the old session gone and no new one
            info, token = self.membership.join(joining, identity=identity)
            self.phases.hand_over(self._round, info)  # a restarted client rejoins its round
        missing = self.requirements.shortfall(info) if self.requirements is not None else None
        if missing is not None:
            log.warning(
                "client %s takes no tasks: %s (the coordinator's capability requirements)",
                escape(info.name or info.client_id),
                missing,
            )
        return info, token

    def authenticate(self, client_id: str, token: str) -> ClientRecord:
        """The client's record, marked alive (``Membership.authenticate``; AuthenticationError)."""
        return self.membership.authenticate(client_id, token)

    def _fail_removed(self, record: ClientRecord, reason: str) -> None:
        """A client left the membership: its open task fails now (lock held)."""
        self.carried.drop_client(record.info.client_id)
        if self._round is not None and self._round.depart(record.info, reason):
            self._wake.notify("round")

    def report_failure(self, client_id: str, token: str, task_id: str, reason: str) -> None:
        """The client's ``fit``, ``evaluate`` or message handler raised: its task fails at once
        with ``reason`` (``Departures.report_failure``).

        Raises:
            AuthenticationError, StaleTaskError: unknown session, or no open task ``task_id``.
            DuplicateUpdateError: its result for the task was already accepted.
            InvalidUpdateError: an oversized reason (nothing recorded).
        """
        self.departures.report_failure(client_id, token, task_id, reason)

    def leave(self, client_id: str, token: str, reason: str) -> None:
        """The client is going (stopped, interrupted, crashed): removed at once, its open task
        failed (``Departures.leave``).

        Raises:
            AuthenticationError: unknown session.
            InvalidUpdateError: an oversized reason (nothing changed).
        """
        self.departures.leave(client_id, token, reason)

    def heartbeat(self, client_id: str, token: str, progress: Any = None) -> float:
        """Marks the client alive; ``progress`` (a ``TaskProgress`` message): where its running
        task is, kept for the status page (``server/progress.py``; checked first: a bad one is
        refused, ``InvalidUpdateError``, and changes nothing)."""
        figures = check_progress(progress) if progress is not None else None
        record = self.authenticate(client_id, token)
        record.progress = figures
        return self.heartbeat_interval_s

    async def poll_async(self, client_id: str, token: str, wait_s: float) -> PollResult:
        """Long poll: waits up to ``wait_s`` for a task for this client (``Polls.wait``)."""
        return await self.polls.wait(client_id, token, wait_s)

    def _open_task(self, client_id: str, task_id: str) -> RoundTask:
        self.storage.check()  # stopping after a full disk: UNAVAILABLE, the client retries the restart
        rnd = self._round
        if rnd is None or rnd.task_id != task_id:
            rnd = self.carried.get(task_id)
            if rnd is None:
                raise StaleTaskError(f"task {escape(task_id)} is not open (round closed or unknown)")
        if not rnd.open_for(client_id) and not (task_id in self.carried and rnd.landed(client_id)):
            # (A late result that landed is still answered: a retry learns it did.)
            raise StaleTaskError(f"round {rnd.server_round} is closed")
        if client_id not in rnd.assignments:
            raise StaleTaskError(f"client {escape(client_id)} has no task in round {rnd.server_round}")
        return rnd

    # -- message phases -------------------------------------------------------------------
    def send_messages(self, client_id: str, token: str, task_id: str, messages: Mapping[str, bytes]) -> int:
        """A client's messages of an open message phase (``Mailbox.send``)."""
        return self.mailbox.send(client_id, token, task_id, messages)

    async def receive_messages_async(
        self, client_id: str, token: str, task_id: str, start: int, wait_s: float
    ) -> InboxPage:
        """Long poll for the messages relayed to the client (``Mailbox.receive_async``)."""
        return await self.mailbox.receive_async(client_id, token, task_id, start, wait_s)

    def download(
        self, client_id: str, token: str, task_id: str, have_version: int | None = None
    ) -> Iterator[bytes]:
        """The model of the client's open task, as a chunk stream (``Downloads.download``)."""
        return self.downloads.download(client_id, token, task_id, have_version)

    def upload(self, frames: Iterable[bytes], token: str) -> int:
        """Receives one update stream of the session ``token`` (``Uploads.upload``); returns
        the payload bytes accepted."""
        with self.storage.watch(self.spill.dir):  # the disk refusing it is a StorageError: the fleet stops
            return self.uploads.upload(frames, token)

    def upload_status(self, client_id: str, token: str, task_id: str) -> tuple[int, bool]:
        """(chunks of a broken upload the coordinator holds, whether the update already landed)."""
        return self.uploads.status(client_id, token, task_id)

    @property
    def task_scope(self) -> str:
        """Part of every task id (set it before a round, e.g. ``g7`` for global round 7)."""
        return self._task_scope

    @task_scope.setter
    def task_scope(self, scope: str) -> None:
        if len(scope) > 64 or not all(ch.isascii() and (ch.isalnum() or ch in "-_.") for ch in scope):
            raise ValueError(f"task_scope must be at most 64 of [A-Za-z0-9._-], got {scope!r}")
        self._task_scope = scope

    def polls_held(self, client_id: str) -> int:
        """Long polls ``client_id`` holds now (0 for an unknown client)."""
        return self.polls.held(client_id)

    @property
    def current_round(self) -> RoundTask | None:
        """The phase in progress, or closed and not yet committed (``None`` between rounds).

        For status pages and tests: read it, never change it.
        """
        return self._round

    # -- Fleet -----------------------------------------------------------------------------
    def live_clients(self) -> list[ClientInfo]:
        """Every client heartbeating, benched ones included (``wait_for_clients`` leaves those out)."""
        with self._lock:
            return self.membership.live()

    def wait_for_clients(self, *, min_clients: int, timeout: timedelta) -> list[ClientInfo]:
        """The selectable clients (live, meeting the ``requirements``, not benched for a missed
        deadline, not on a late task), once ``min_clients`` live clients meeting them are present
        and one is selectable: a benched client counts toward ``min_clients`` but is not asked,
        so one straggler never stops a run whose ``--min-clients`` is the fleet's size.
        While it waits it logs ``waiting for N clients (k joined)`` every ``WAITING_REPORT_S``
        and whenever k has moved by a tenth of N (at least 1) or identity conflicts first appear
        since the last line: a coordinator waiting for minutes says what it waits for, and a flood
        of Joins writes about ten lines, not one a Join."""
        deadline = self.clock.now() + timeout.total_seconds()
        reported: tuple[int, bool] | None = None
        step = max(1, min_clients // 10)
        next_report = self.clock.now()
        with self._lock:
            while True:
                self.carried.expire()
                # O(1) first: the O(clients) scan only once enough are registered (a join wakes this).
                joined = len(self.membership.records)
                enough = joined >= min_clients
                live = self.membership.live() if enough or self.clock.now() >= deadline else []
                unfit = 0
                if self.requirements is not None:
                    qualifying = [c for c in live if self.requirements.eligible(c)]
                    unfit, live = len(live) - len(qualifying), qualifying
                # Benched clients, and those still on a task carried past its round's quorum
                # (semi-asynchronous rounds), count as live but are not selected until they report.
                benched = {c.client_id for c in live if self.membership.records[c.client_id].benched_task}
                busy = self.carried.busy() | benched
                free = [c for c in live if c.client_id not in busy]
                if len(live) >= min_clients and free:
                    return free
                conflicts = self.membership.conflict_note()  # two processes on one identity
                moved = (
                    reported is None or abs(joined - reported[0]) >= step or bool(conflicts) != reported[1]
                )
                if moved or self.clock.now() >= next_report:
                    log.info(
                        "waiting for %d clients (%d joined%s%s)",
                        min_clients,
                        joined,
                        f", {unfit} short of the capability requirements" if unfit else "",
                        conflicts,
                    )
                    reported, next_report = (joined, bool(conflicts)), self.clock.now() + WAITING_REPORT_S
                if self._interrupted:
                    self.storage.check()
                    raise InterruptedRunError("stopped while waiting for clients")
                now = self.clock.now()
                if now >= deadline:
                    raise TimeoutError(_shortfall(len(live), len(benched), unfit, min_clients, timeout))
                self._wake.wait_until(
                    "membership", min(deadline, now + self.heartbeat_interval_s, next_report)
                )

    def fit_round(
        self,
        *,
        server_round: int,
        global_state: ModelState,
        assignments: Sequence[tuple[ClientInfo, FitIns]],
        timeout: timedelta,
        target: int | None = None,
        quorum: Quorum | None = None,
    ) -> RoundOutcome[FitRes]:
        """A fit phase (``Phases.fit``). Under a ``quorum``, it closes at the quorum (and its
        grace), the clients it did not wait for keep their task, and the outcome carries the
        late results of earlier rounds that landed until it closed (``RoundOutcome.late``)."""
        with self._lock:
            self.carried.open_fit(server_round, quorum)
        outcome = self.phases.fit(
            server_round=server_round,
            global_state=global_state,
            assignments=assignments,
            timeout=timeout,
            target=target,
            quorum=quorum,
        )
        if quorum is None:
            return outcome
        with self._lock:
            late = self.carried.close_fit(server_round, self._round)
        return dataclasses.replace(outcome, late=late)

    def evaluate_round(
        self,
        *,
        server_round: int,
        global_state: ModelState,
        assignments: Sequence[tuple[ClientInfo, EvaluateIns]],
        timeout: timedelta,
    ) -> RoundOutcome[EvaluateRes]:
        """An evaluation phase (``Phases.evaluate``)."""
        return self.phases.evaluate(
            server_round=server_round, global_state=global_state, assignments=assignments, timeout=timeout
        )

    def message_round(
        self,
        *,
        server_round: int,
        phase: str,
        assignments: Sequence[tuple[ClientInfo, MessageIns]],
        timeout: timedelta,
    ) -> RoundOutcome[MessageRes]:
        """Runs message phase ``phase``: clients poll a ``MESSAGE`` task, send their messages
        (``send_messages``), and once the phase closed fetch the ones relayed to them
        (``receive_messages_async``), until this round is committed (``Phases.message``)."""
        return self.phases.message(
            server_round=server_round, phase=phase, assignments=assignments, timeout=timeout
        )

    def _open_round(self, rnd: RoundTask) -> None:
        """``rnd`` becomes the open round (lock held): polls, uploads and downloads serve it."""
        self._round = rnd

    def committed(self, server_round: int) -> None:
        with self._lock:
            if self._round is not None and self._round.closed:
                self._round = None  # frees the round's models and results
            keep = self.carried.committed()  # the tasks whose late results can still come or wait
        self.mailbox.clear(server_round)
        self.spill.clear(keep=keep)

    def close(self) -> None:
        self.spill.close()

    def interrupt(self) -> None:
        with self._lock:
            self._interrupted = True
            if self._round is not None:
                self._round.closed = True  # in-flight uploads are refused cleanly
            self._wake.notify_all()

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            carried = self.carried.state_list()
        return {
            "run_id": self.run_id,
            "clients": self.membership.state_dict(),
            "downlink": self.downlink.state_dict(),
            "carried": carried,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the run id and membership: clients keep their sessions across a restart.

        Restored clients get a grace period before silence counts against them: they may be
        sleeping in retry backoff (capped at ``RETRY_MAX_WAIT_S``) while the coordinator restarts.
        Tasks carried past a quorum come back with their model and the late results that
        had landed and were not merged by the checkpoint's round (``CarriedTasks.load``).
        """
        with self._lock:
            self.run_id = str(state["run_id"])
            if state.get("downlink") is not None:
                self.downlink.load_state_dict(state["downlink"])
            self.membership.load_state_dict(
                state["clients"], seen_at=self.clock.now() + RETRY_MAX_WAIT_S + RESTART_GRACE_S
            )
            self.carried.load(state.get("carried", ()), RETRY_MAX_WAIT_S + RESTART_GRACE_S)
            self._wake.notify_all()

    def finish(self, *, timeout: timedelta) -> None:
        deadline = self.clock.now() + timeout.total_seconds()
        with self._lock:
            self._finished = True
            self._wake.notify_all()
            while True:
                live = {info.client_id for info in self.membership.live()}
                waiting = [
                    r
                    for r in self.membership.records.values()
                    if not r.heard_finished and r.info.client_id in live
                ]
                now = self.clock.now()
                if not waiting or now >= deadline:
                    return
                self._wake.wait_until("finish", min(deadline, now + 0.5))


def _shortfall(live: int, benched: int, unfit: int, min_clients: int, waited: timedelta) -> str:
    """Why ``wait_for_clients`` gave up: too few live clients, or none of them free for a task."""
    short = live < min_clients  # else enough, but each is benched or still on a late task
    text = f"{live if short else 0} live clients{'' if short else ' free for a task'} after "
    text += f"{waited.total_seconds():.0f}s, need {min_clients}"
    if benched:
        text += f" ({benched} {'of them' if short else 'more'} benched after missing a deadline)"
    return text + (f" ({unfit} more short of the capability requirements)" if unfit else "")
