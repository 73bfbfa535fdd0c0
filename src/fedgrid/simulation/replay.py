"""Replaying a semi-asynchronous deployment's merges in simulation: the determinism contract
of quorum rounds (docs/determinism.rst).

Under ``min_quorum`` which results enter which round depends on arrival times, so a free
simulation cannot reproduce a deployment. The coordinator records each merge instead (the
``merged`` events of ``events.jsonl``: per result its client's name, its task round, its
staleness and weight), and ``ReplayFleet`` follows that record: in round ``r`` it trains
each recorded result's client (matched by name: client ``i`` of ``fedgrid client
--partition i/N`` is simulated client ``i``) from the global model of its task round, with
its task of that round, through the simulated fleet's upload path, and hands the engine
exactly the recorded set: the results of round ``r``'s own tasks as fresh results, the
others as ``LateResult`` with their task's model. The engine then merges them as the
coordinator did, so on the sequential engine at the same thread count the model equals the
deployment's bit for bit.

A redone round (after a coordinator restart) appears twice in the record; its last merge is
the committed one. A client's results that never entered a merge (refused as too stale,
lost) are not trained in the replay: with a lossless uplink nothing of them stays in the
client, with a lossy one its error-feedback residual does, and the replay differs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Sequence

from fedgrid.aggregation.staleness import staleness_weight
from fedgrid.errors import ConfigError
from fedgrid.events import read_events
from fedgrid.fleet.base import Fleet, LateResult, Quorum, RoundOutcome
from fedgrid.simulation.fleet import InProcessFleet
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

__all__ = ["RecordedResult", "RecordedMerge", "read_merges", "ReplayFleet"]


@dataclass(frozen=True)
class RecordedResult:
    """One result of a recorded merge (a ``merged`` event's ``results`` entry)."""

    name: str
    task_round: int
    staleness: int
    num_examples: int
    weight: float


@dataclass(frozen=True)
class RecordedMerge:
    """What entered round ``round``'s merge, in the order the coordinator recorded it."""

    round: int
    results: tuple[RecordedResult, ...]


def read_merges(path: str | os.PathLike[str]) -> dict[int, RecordedMerge]:
    """The merges of an ``events.jsonl`` file, by round; of a round merged twice (redone
    after a restart), the last.

    Raises:
        ConfigError: (key ``replay``) the file is missing or holds no ``merged`` event.
    """
    try:
        events = read_events(path)
    except OSError as exc:
        raise ConfigError("replay", f"cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from exc
    merges: dict[int, RecordedMerge] = {}
    for event in events:
        if event.event != "merged":
            continue
        results = tuple(
            RecordedResult(
                name=str(entry["name"]),
                task_round=int(entry["task_round"]),
                staleness=int(entry["staleness"]),
                num_examples=int(entry["num_examples"]),
                weight=float(entry["weight"]),
            )
            for entry in event["results"]
        )
        merges[int(event["round"])] = RecordedMerge(int(event["round"]), results)
    if not merges:
        raise ConfigError(
            "replay",
            f"{os.fspath(path)!r} records no merge: it is the events.jsonl of a coordinator run with min_quorum",
        )
    return merges


class ReplayFleet(Fleet):
    """Runs the recorded merges of a deployment over ``inner``'s simulated clients.

    Args:
        inner: the simulated fleet (sequential engine, lossless downlink).
        merges: the record (``read_merges``).
        staleness_exponent: the run's ``a``; each recorded weight must be the one it gives.

    Raises:
        ConfigError: a lossy downlink (its clients' held versions follow the live rounds,
            which the replay reorders).
    """

    def __init__(
        self, inner: InProcessFleet, merges: Mapping[int, RecordedMerge], *, staleness_exponent: float
    ) -> None:
        if not inner.downlink.lossless:
            raise ConfigError("replay", "needs a lossless downlink (downlink_codec none)")
        self.inner = inner
        self.merges = dict(merges)
        self.staleness_exponent = staleness_exponent
        # The model and tasks of each round, kept until the last merge that needs them.
        self._tasks: dict[int, tuple[ModelState, dict[str, tuple[ClientInfo, FitIns]]]] = {}
        self._last_use: dict[int, int] = {}
        for merge in self.merges.values():
            for res in merge.results:
                self._last_use[res.task_round] = max(self._last_use.get(res.task_round, 0), merge.round)

    def wait_for_clients(self, *, min_clients: int, timeout: timedelta) -> list[ClientInfo]:
        return self.inner.wait_for_clients(min_clients=min_clients, timeout=timeout)

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
        """The recorded merge of ``server_round``: each of its results trained from its task's
        model. Raises ``ConfigError`` (key ``replay``) when the record and this simulation
        disagree (a round or client it lacks, a weight another exponent made, a client that
        fails here)."""
        self._tasks[server_round] = (global_state, {info.name: (info, ins) for info, ins in assignments})
        merge = self.merges.get(server_round)
        if merge is None:
            raise ConfigError(
                "replay", f"the record has no merge of round {server_round}: replay fewer rounds"
            )
        fresh: list[FitRes] = []
        late: list[LateResult] = []
        bytes_up = bytes_down = 0
        for entry in merge.results:
            base, tasks = self._task(entry, server_round)
            info, ins = tasks[entry.name]
            outcome = self.inner.fit_round(
                server_round=entry.task_round, global_state=base, assignments=[(info, ins)], timeout=timeout
            )
            if not outcome.results:
                reason = outcome.failures[0].reason if outcome.failures else "no result"
                raise ConfigError(
                    "replay", f"client {entry.name!r} failed its task of round {entry.task_round}: {reason}"
                )
            bytes_up, bytes_down = bytes_up + outcome.bytes_up, bytes_down + outcome.bytes_down
            if entry.task_round == server_round:
                fresh.append(outcome.results[0])
            else:
                late.append(LateResult(outcome.results[0], entry.task_round, base))
        for task_round in [t for t, last in self._last_use.items() if last <= server_round]:
            self._tasks.pop(task_round, None)  # no later merge needs its model
        if self._last_use.get(server_round, 0) <= server_round:
            self._tasks.pop(server_round, None)
        return RoundOutcome(fresh, [], bytes_up=bytes_up, bytes_down=bytes_down, late=late)

    def _task(
        self, entry: RecordedResult, server_round: int
    ) -> tuple[ModelState, dict[str, tuple[ClientInfo, FitIns]]]:
        """The model and tasks of ``entry``'s task round, after checking ``entry`` against them."""
        if entry.staleness != server_round - entry.task_round or entry.task_round not in self._tasks:
            raise ConfigError(
                "replay",
                f"round {server_round}'s record holds a result of round {entry.task_round} it cannot replay",
            )
        weight = staleness_weight(entry.num_examples, entry.staleness, self.staleness_exponent)
        if entry.task_round != server_round and weight != entry.weight:
            raise ConfigError(
                "staleness_exponent",
                f"the record's weight {entry.weight} of a result {entry.staleness} rounds stale is not "
                f"{weight}: pass the deployment's staleness_exponent",
            )
        base, tasks = self._tasks[entry.task_round]
        if entry.name not in tasks:
            raise ConfigError(
                "replay",
                f"client {entry.name!r} of the record has no task in round {entry.task_round} here "
                "(simulate as many clients as the deployment had, selecting all: fraction_fit 1)",
            )
        return base, tasks

    def evaluate_round(
        self,
        *,
        server_round: int,
        global_state: ModelState,
        assignments: Sequence[tuple[ClientInfo, EvaluateIns]],
        timeout: timedelta,
    ) -> RoundOutcome[EvaluateRes]:
        return self.inner.evaluate_round(
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
        return self.inner.message_round(
            server_round=server_round, phase=phase, assignments=assignments, timeout=timeout
        )

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()
