"""The quorum's late results: fit tasks that a semi-asynchronous round (``Quorum``) closed at its
quorum with clients still on them, kept until each of their results was merged into a later
round or can no longer come.

A carried task holds its model (the base its late results are differences from); the
clients still on it are busy (not selected again until they report), benched once its
deadline passes, and freed when they leave. The late results that landed are collected
into the round they are merged into, in a canonical order; a task goes once none of its
results can come or wait. Carried tasks survive a restart with their model and the landed,
unmerged results (restored from the spill), unless their clients hold a lossy downlink's
shadow (docs/failures.rst).

``CarriedTasks`` is a part of ``RemoteFleet`` (``server/remote_fleet.py``): it shares the
fleet's lock (the membership's), and every method is called with that lock held.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable, Mapping

from fedgrid.config_compression import task_uplink_codec
from fedgrid.events import EventLog
from fedgrid.fleet.base import LateResult, Quorum
from fedgrid.fleet.downlink import RoundDownlink
from fedgrid.proto import serde
from fedgrid.server.membership import Membership
from fedgrid.server.rounds import RoundTask
from fedgrid.server.spill import UpdateSpill
from fedgrid.textsafe import escape
from fedgrid.types import ClientInfo, EvaluateIns, FitIns, FitRes, MessageIns, TensorSpec

__all__ = ["CarriedTasks"]

log = logging.getLogger(__name__)


class CarriedTasks:
    """The fit tasks carried past their round's quorum, by task id, and the round their late
    results are merged into (the open fit round, or the next).

    Args:
        membership: the fleet's clients (its lock is the fleet's).
        spill: where the late results wait for their merge.
        events: where restored late results are reported.
    """

    def __init__(self, membership: Membership, spill: UpdateSpill, events: EventLog) -> None:
        self.membership = membership
        self.spill = spill
        self.events = events
        self.tasks: dict[str, RoundTask] = {}
        self.quorum: Quorum | None = None
        self.merge_round = 0

    def get(self, task_id: str) -> RoundTask | None:
        """The carried task ``task_id``, or ``None``."""
        return self.tasks.get(task_id)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self.tasks

    def open_fit(self, server_round: int, quorum: Quorum | None) -> None:
        """Fit round ``server_round`` opens (under ``quorum``, or none): late results landing
        while it is open are merged into it; carried tasks past their deadline expire."""
        self.quorum = quorum
        self.merge_round = server_round
        self.expire()

    def close_fit(self, server_round: int, rnd: RoundTask | None) -> list[LateResult]:
        """A quorum's fit round ``server_round`` closed (its task ``rnd``): the clients still on
        the task are carried, and the late results landed so far are collected for the round;
        later ones go to the next."""
        if rnd is not None and rnd.carried:
            self.tasks[rnd.task_id] = rnd
        late = self._collect()
        self.merge_round = server_round + 1
        return late

    def busy(self) -> set[str]:
        """The clients on a carried task."""
        busy: set[str] = set()
        for rnd in self.tasks.values():
            busy |= rnd.carried
        return busy

    def refusal(self, rnd: RoundTask) -> str | None:
        """Why a late upload for carried task ``rnd`` cannot be merged (``Quorum.refusal``)."""
        if self.quorum is None:
            return None
        return self.quorum.refusal(task_round=rnd.server_round, merge_round=self.merge_round)

    def expire(self) -> None:
        """Carried tasks past their deadline: the clients still on them (and not uploading)
        are benched, as a round's deadline benches them; their result is no longer taken.
        Clients dropped from the membership (silent) leave their carried task too."""
        now = self.membership.clock.now()
        for rnd in self.tasks.values():
            rnd.carried &= set(self.membership.records)
            if now < rnd.deadline:
                continue
            for cid in sorted(rnd.carried - rnd.uploading):
                rnd.carried.discard(cid)
                partial = rnd.partials.pop(cid, None)
                if partial is not None:
                    partial.abort()
                record = self.membership.records.get(cid)
                if record is not None:
                    record.benched_task = rnd.task_id
                log.warning(
                    "round %d: client %s missed its task's deadline (carried past the quorum)",
                    rnd.server_round,
                    escape(rnd.clients[cid].name or cid),
                )

    def drop_client(self, client_id: str) -> None:
        """``client_id`` left the membership: its late results will not come."""
        for carried in self.tasks.values():
            if client_id in carried.carried:
                carried.carried.discard(client_id)
                partial = carried.partials.pop(client_id, None)
                if partial is not None:
                    partial.abort()

    def _collect(self) -> list[LateResult]:
        """The late results landed so far, moved to their task's ``merged`` set, ordered by
        task round then client (a canonical order)."""
        late: list[LateResult] = []
        for rnd in sorted(self.tasks.values(), key=lambda r: r.server_round):
            for cid in sorted(rnd.late, key=lambda c: rnd.clients[c].sort_key):
                late.append(LateResult(rnd.late.pop(cid), rnd.server_round, rnd.global_state))
                rnd.merged.add(cid)
        return late

    def committed(self) -> set[str]:
        """A round was committed: the merged results' spill files go, and so does a carried task
        (with its model) once no result of it can come or wait. Returns the task ids kept."""
        for task_id, rnd in list(self.tasks.items()):
            for cid in rnd.merged:
                self.spill.discard(task_id=task_id, client_id=cid)
            if not rnd.carried and not rnd.late:
                del self.tasks[task_id]
        return set(self.tasks)

    # -- across a restart ------------------------------------------------------------------
    def state_list(self) -> list[dict[str, Any]]:
        """The carried tasks a restarted coordinator restores (``load``)."""
        saved = [self._task_state(rnd) for rnd in self.tasks.values()]
        return [s for s in saved if s is not None]

    def _task_state(self, rnd: RoundTask) -> dict[str, Any] | None:
        """What a restarted coordinator needs of a task carried past its round's quorum: its
        model (the base of its late results), its clients' tasks, which of them are still on
        it, which landed and which are merged (their spilled updates are restored, but for
        the merged ones, so that each enters exactly one merge). ``None`` for a task whose
        clients hold a lossy downlink's shadow (not restored: their results are refused after
        a restart, docs/failures.rst)."""
        if rnd.downlink is None or not rnd.downlink.exact:
            return None
        open_to = sorted(rnd.carried | set(rnd.late) | rnd.merged)
        return {
            "task_id": rnd.task_id,
            "round": rnd.server_round,
            "base": rnd.global_state,
            "remaining_s": max(0.0, rnd.deadline - self.membership.clock.now()),
            "carried": sorted(rnd.carried),
            "merged": sorted(rnd.merged),
            "tasks": [
                {
                    "client": dataclasses.asdict(rnd.clients[cid]),
                    "config": dict(rnd.assignments[cid].config),
                    "download": getattr(rnd.assignments[cid], "download", None),
                }
                for cid in open_to
            ],
        }

    def load(self, saved: Iterable[Mapping[str, Any]], grace_s: float) -> None:
        """Replaces the carried tasks with those of ``state_list``, each given ``grace_s`` more
        than it had left, its landed and unmerged results restored from the spill."""
        self.tasks = {}
        for task in saved:
            rnd = self._load_task(task, grace_s)
            self.tasks[rnd.task_id] = rnd
            if rnd.late:
                self.events.emit("updates_restored", round=rnd.server_round, count=len(rnd.late))

    def _load_task(self, saved: Mapping[str, Any], grace_s: float) -> RoundTask:
        """A carried task from ``_task_state``, its landed and unmerged results restored from the spill."""
        infos = {
            str(t["client"]["client_id"]): ClientInfo(
                **{**t["client"], "codecs": tuple(t["client"].get("codecs", ("none",)))}
            )
            for t in saved["tasks"]
        }
        server_round = int(saved["round"])
        assignments: dict[str, FitIns | EvaluateIns | MessageIns] = {
            str(t["client"]["client_id"]): FitIns(
                round=server_round,
                config=dict(t["config"]),
                download=None if t["download"] is None else tuple(t["download"]),
            )
            for t in saved["tasks"]
        }
        base = saved["base"]
        rnd = RoundTask(
            server_round=server_round,
            task_id=str(saved["task_id"]),
            kind="fit",
            assignments=assignments,
            clients=infos,
            deadline=self.membership.clock.now() + float(saved["remaining_s"]) + grace_s,
            downlink=RoundDownlink(base=base, version=0, _full=serde.EncodedModel(base)),
            expected=dict(TensorSpec.of(base)),
            closed=True,
            closed_by="quorum",
            carried=set(saved["carried"]),
            merged=set(saved["merged"]),
            codecs={cid: task_uplink_codec(ins.config) for cid, ins in assignments.items()},
        )
        for cid, res in self.spill.restore(task_id=rnd.task_id, assigned=infos).items():
            if cid not in rnd.merged and isinstance(res, FitRes):
                rnd.carried.discard(cid)
                rnd.late[cid] = res
        return rnd
