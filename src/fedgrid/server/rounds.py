"""The open task of a round (one phase: fit, evaluate or a message phase).

A ``RoundTask`` is what the fleet holds while a phase runs: its assignments, the results
and failures so far, the bytes moved and, for a fit or evaluate phase, the model clients
download. The rules of message phases (``check_outbox``, ``relay``) are the per-client
protocol's (``fleet/protocol.py``), shared by ``RemoteFleet`` and ``InProcessFleet``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from fedgrid.aggregation.lora_ranks import RankViews, specs_at_rank
from fedgrid.compression.spec import CodecSpec
from fedgrid.fleet.downlink import RoundDownlink
from fedgrid.fleet.protocol import RoundTally
from fedgrid.proto import serde
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
)

if TYPE_CHECKING:
    from fedgrid.server.membership import Membership
    from fedgrid.server.uploads import Upload
    from fedgrid.server.wakeups import Wakeups

__all__ = ["RoundTask", "wait_for_close", "Inbox"]

#: Messages relayed to one client: payload by sender's client id, in the phase's peer order.
Inbox = "OrderedDict[str, bytes]"


@dataclass
class RoundTask:
    """One phase of a round, open on the fleet (or closed and not yet committed)."""

    server_round: int
    task_id: str
    kind: str  # FIT, EVALUATE, or the name of a message phase
    assignments: dict[str, FitIns | EvaluateIns | MessageIns]
    clients: dict[str, ClientInfo]  # the assigned clients, by id
    deadline: float
    downlink: RoundDownlink | None = (
        None  # fit/evaluate: what clients download; .base is the model they then hold
    )
    expected: dict[str, TensorSpec] = field(default_factory=dict)
    # A fit phase: each client's uplink codec, as its task's config names it (``CodecPolicy.uplink``).
    codecs: dict[str, CodecSpec] = field(default_factory=dict)
    results: dict[str, FitRes | EvaluateRes | MessageRes] = field(default_factory=dict)
    failures: dict[str, Failure] = field(default_factory=dict)
    uploading: set[str] = field(default_factory=set)
    partials: dict[str, "Upload"] = field(default_factory=dict)  # broken uploads, by client
    closed: bool = False
    closed_by: str = ""  # why it closed: one of fedgrid.events.CLOSE_REASONS
    tally: RoundTally = field(default_factory=RoundTally)  # the bytes moved (``fleet/protocol.py``)
    parts: dict[frozenset[str], serde.EncodedModel] = field(
        default_factory=dict
    )  # partial downloads, by tensors
    inboxes: dict[str, "OrderedDict[str, bytes]"] | None = None  # message phase: set when it closed
    # A fit phase closed at its quorum: the clients still working on their task (they may
    # upload until its deadline), and their results that landed, not yet handed to a merge.
    carried: set[str] = field(default_factory=set)
    late: dict[str, FitRes] = field(default_factory=dict)
    merged: set[str] = field(default_factory=set)  # late results handed to a merge
    quorum_at: float | None = None  # when its quorum was reached (the fleet clock's time)
    # Clients whose task failed because their session ended (left, dropped silent, replaced):
    # a new session of the same name takes the task over while the phase is open (``hand_over``).
    departed: set[str] = field(default_factory=set)
    # The round's model at each LoRA rank its clients announced (``fedgrid.aggregation.lora_ranks``).
    rank_views: RankViews | None = None

    def uplink_codec(self, client_id: str) -> CodecSpec:
        """The uplink codec of ``client_id``'s task (``none`` for a task that names none)."""
        return self.codecs.get(client_id, CodecSpec.NONE)

    def at_rank(self, client_id: str) -> tuple[ModelState, dict[str, TensorSpec]] | None:
        """A client of another LoRA rank than the round's model: that model at its rank and the
        specs its upload must have; ``None`` for any other client."""
        rank = self.clients[client_id].lora_rank
        if self.rank_views is None:
            self.rank_views = RankViews(self.global_state)
        if not self.rank_views.differs(rank):
            return None
        return self.rank_views.at(rank), dict(specs_at_rank(self.expected, rank))

    @property
    def bytes_up(self) -> int:
        return self.tally.bytes_up

    @bytes_up.setter
    def bytes_up(self, value: int) -> None:
        self.tally.bytes_up = value

    @property
    def bytes_down(self) -> int:
        return self.tally.bytes_down

    @bytes_down.setter
    def bytes_down(self, value: int) -> None:
        self.tally.bytes_down = value

    @property
    def evaluate(self) -> bool:
        """An evaluation: clients send metrics, no tensors."""
        return self.kind == EVALUATE

    @property
    def is_message(self) -> bool:
        return self.kind not in (FIT, EVALUATE)

    @property
    def global_state(self) -> ModelState:
        """What difference uploads apply to (= the downlink's base)."""
        assert self.downlink is not None, "a message phase has no model"
        return self.downlink.base

    def close(
        self, reason: str
    ) -> tuple[list[FitRes | EvaluateRes | MessageRes], list[Failure], list[ClientInfo]]:
        """Closes the phase (lock held): late uploads are refused from here on, broken ones are
        dropped. Returns the results, failures and cancelled clients, in assignment order;
        ``closed_by`` is ``reason``, or ``target`` when clients were left over after ``all``.

        ``quorum`` (a semi-asynchronous round): the pending clients are not cancelled but
        ``carried``: their task stays open to them, broken uploads included."""
        self.closed = True
        pending = self.pending()
        if reason == "quorum":
            self.carried = set(pending)
        for cid, partial in list(self.partials.items()):
            if cid not in self.carried:
                partial.abort()
                del self.partials[cid]
        results = [self.results[cid] for cid in self.assignments if cid in self.results]
        failures = [self.failures[cid] for cid in self.assignments if cid in self.failures]
        cancelled = [] if self.carried else [self.clients[cid] for cid in pending]  # over-selected
        self.closed_by = "target" if reason == "all" and cancelled else reason
        return results, failures, cancelled

    def depart(self, client: ClientInfo, reason: str) -> bool:
        """The client's session ended (it left, was dropped or replaced): its pending task fails
        with ``reason`` while the phase is open, a broken upload of it is dropped, and a new
        session of its name may take the task over (``hand_over``). Returns whether it failed."""
        cid = client.client_id
        if self.closed or not self.is_pending(cid):
            return False
        self.failures[cid] = Failure(client, reason)
        self.departed.add(cid)
        partial = self.partials.pop(cid, None)
        if partial is not None:
            partial.abort()
        return True

    def hand_over(self, joined: ClientInfo) -> str | None:
        """Gives the task of an earlier session of ``joined``'s name to ``joined`` (lock held),
        when the phase is open and that session's task is pending or failed only because the
        session ended (a region or client restarted mid-round rejoins its round: the same
        task, the same seed). Fit and evaluate phases only. Returns the earlier session's id,
        or ``None``."""
        if self.closed or self.is_message or not joined.name or joined.client_id in self.assignments:
            return None  # (a message phase's peers name the old session: its task cannot move)
        old = next(
            (
                cid
                for cid, info in self.clients.items()
                if info.name == joined.name and (self.is_pending(cid) or cid in self.departed)
            ),
            None,
        )
        if old is None or self.landed(old):
            return None
        # In place, keeping the assignment order (results are listed in it).
        moved = [(joined.client_id if cid == old else cid, ins) for cid, ins in self.assignments.items()]
        self.assignments.clear()
        self.assignments.update(moved)
        infos = [
            (joined.client_id, joined) if cid == old else (cid, info) for cid, info in self.clients.items()
        ]
        self.clients.clear()
        self.clients.update(infos)
        if old in self.codecs:
            self.codecs[joined.client_id] = self.codecs.pop(old)
        self.failures.pop(old, None)
        self.departed.discard(old)
        partial = self.partials.pop(old, None)
        if partial is not None:
            partial.abort()
        return old

    def landed(self, client_id: str) -> bool:
        """Whether the client's result was accepted: in the round, or late (merged or not)."""
        return client_id in self.results or client_id in self.late or client_id in self.merged

    def open_for(self, client_id: str) -> bool:
        """Whether an upload of ``client_id`` may still land: the phase is open, or closed at
        its quorum with the client's task carried."""
        return not self.closed or client_id in self.carried

    def pending_count(self) -> int:
        """O(1): results and failures are disjoint subsets of the assignments."""
        return len(self.assignments) - len(self.results) - len(self.failures)

    def pending(self) -> list[str]:
        return [cid for cid in self.assignments if cid not in self.results and cid not in self.failures]

    def is_pending(self, client_id: str) -> bool:
        """O(1): a long poll asks this on every wake-up, with every client polling."""
        return (
            client_id in self.assignments and client_id not in self.results and client_id not in self.failures
        )


def wait_for_close(
    rnd: RoundTask,
    *,
    goal: int,
    membership: "Membership",
    wake: "Wakeups",
    interrupted: Callable[[], bool],
    check_every_s: float,
    timeout_s: float,
    grace_s: float | None = None,
) -> str:
    """Waits (lock held) until ``rnd`` has ``goal`` results or no pending client, failing the
    clients that went silent (checked every ``check_every_s``), that missed the deadline
    (the ones still alive are benched) or that the coordinator's stop cut off.

    ``grace_s`` (a semi-asynchronous round; ``goal`` is then its quorum): once ``goal``
    results are in, it waits up to ``grace_s`` more for the rest (``rnd.quorum_at`` records
    when the quorum was reached), and a close with clients pending is a ``quorum`` close.

    Returns:
        Why it stopped waiting: ``all``, ``quorum``, ``deadline`` or ``stopping``
        (``RoundTask.close``'s reason).
    """
    infos = rnd.clients
    # Results and failures are disjoint subsets of the assignments, so the pending count
    # is O(1); liveness (O(clients)) is checked once a heartbeat interval, not per upload.
    next_check = 0.0
    while rnd.pending_count():
        now = wake.clock.now()
        if len(rnd.results) >= goal:
            if grace_s is None:
                break
            if rnd.quorum_at is None:
                rnd.quorum_at = now
            if now >= rnd.quorum_at + grace_s:
                return "quorum"
        if interrupted():
            for cid in rnd.pending():
                rnd.failures[cid] = Failure(infos[cid], "coordinator stopping")
            return "stopping"
        if now >= rnd.deadline:
            for cid in rnd.pending():
                rnd.failures[cid] = Failure(infos[cid], f"missed the round deadline of {timeout_s:.1f}s")
                record = membership.records.get(cid)
                if record is not None and cid not in rnd.uploading:  # alive, yet no result: benched
                    record.benched_task = rnd.task_id
            return "deadline"
        if now >= next_check:
            _fail_silent(rnd, membership)
            next_check = now + check_every_s
            continue
        until = min(rnd.deadline, next_check)
        if rnd.quorum_at is not None and grace_s is not None:
            until = min(until, rnd.quorum_at + grace_s)
        wake.wait_until("round", until)
    return "all"


def _fail_silent(rnd: RoundTask, membership: "Membership") -> None:
    """Fails the pending clients that went silent (lock held); a rejoin takes their task over."""
    live = {info.client_id for info in membership.live()}
    for cid in rnd.pending():
        if cid not in live and cid not in rnd.uploading:
            rnd.failures[cid] = Failure(rnd.clients[cid], "client went silent (no heartbeat)")
            rnd.departed.add(cid)
