"""Merging the late results of semi-asynchronous rounds (``Quorum``; docs/failures.rst).

A result that landed after its round closed at its quorum joins a later round as a difference
from its task's model, weighted ``num_examples * (1 + staleness) ** -a``
(``fedgrid.aggregation.staleness``); each merge is recorded as a ``merged`` event (fresh
results first, then late ones), and one too stale for the quorum's limit as ``late_refused``.
"""

from __future__ import annotations

import logging
from typing import Any

from fedgrid.aggregation.staleness import rebase, staleness_weight
from fedgrid.events import EventLog
from fedgrid.fleet.base import Quorum, RoundOutcome
from fedgrid.textsafe import escape
from fedgrid.types import FitRes

__all__ = ["late_to_merge"]

log = logging.getLogger(__name__)


def late_to_merge(
    quorum: Quorum, server_round: int, outcome: RoundOutcome[FitRes], events: EventLog
) -> list[FitRes]:
    """The late results of ``outcome`` to merge into ``server_round``, as differences from their
    task's model with their staleness weight; records the merge as a ``merged`` event."""
    merged = [_entry(r, server_round, server_round, float(r.num_examples)) for r in outcome.results]
    late: list[FitRes] = []
    for item in outcome.late:
        staleness = server_round - item.task_round
        refusal = quorum.refusal(task_round=item.task_round, merge_round=server_round)
        if refusal is not None:  # landed while no round was open after a restart: the fleet knew no S yet
            log.warning("round %d: %s: not merged", server_round, refusal)
            events.emit(
                "late_refused", round=item.task_round, client=item.result.client.client_id, reason=refusal
            )
            continue
        weight = staleness_weight(item.result.num_examples, staleness, quorum.staleness_exponent)
        late.append(rebase(item.result, item.base, weight=weight))
        merged.append(_entry(item.result, server_round, item.task_round, weight))
        log.info(
            "round %d: merging a late result of round %d from %s (staleness %d, weight %.6g)",
            server_round,
            item.task_round,
            escape(item.result.client.name or item.result.client.client_id),
            staleness,
            weight,
        )
    events.emit("merged", round=server_round, results=merged)
    return late


def _entry(res: FitRes, server_round: int, task_round: int, weight: float) -> dict[str, Any]:
    """One result of a ``merged`` event."""
    return {
        "client": res.client.client_id,
        "name": res.client.name,
        "task_round": task_round,
        "staleness": server_round - task_round,
        "num_examples": res.num_examples,
        "weight": weight,
    }
