"""Rounds that fail instead of committing: a non-finite aggregate, a round whose results were
all lost, and the disk refusing the commit.

- **Non-finite** (``first_non_finite``): the engine keeps the previous model, records the round
  as failed (``ROUND_FAILED`` in its metrics) and goes on with the next one.
- **Lost** (``check_not_lost``, ``LostRounds``): every client or region of the round died,
  left, went silent or missed the deadline, so nothing came back. Committing it empty would
  skip a round number on every tier below (a region's rounds would run 1, 3, 4) and end on
  another model than an uninterrupted run. The round fails (a ``round_failed`` event with the
  reason and the attempt), the strategy goes back to its state before the round, and the
  same round number runs again with the same selection seed, so it draws the same clients
  when they are back. After ``retries`` lost attempts in a row the run stops with
  ``RoundLostError``, its last committed round kept.
- **Storage** (``StorageError``, ``server/disk.py``): the engine stops at once with one line.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any, Callable

import torch

from fedgrid.errors import RoundLostError
from fedgrid.events import EventLog
from fedgrid.fleet.base import Fleet, RoundOutcome
from fedgrid.textsafe import escape
from fedgrid.types import RoundMetrics

__all__ = ["ROUND_FAILED", "ROUND_RETRIES_KEY", "first_non_finite", "check_not_lost", "LostRounds"]

log = logging.getLogger(__name__)

#: ``RoundMetrics.extra`` key of a round whose aggregate was not finite (value 1.0).
ROUND_FAILED = "round_failed"
#: ``RoundMetrics.extra`` key of a round committed after lost attempts: how many were lost.
ROUND_RETRIES_KEY = "round_retries"
#: Failures named in a lost round's reason (the rest are counted).
_NAMED = 3
#: Elements of a tensor checked for NaN and Inf at once (4 MB of float32).
_CHECK_CHUNK = 1 << 20


def first_non_finite(state: Any, where: str = "") -> str | None:
    """The path of the first floating tensor holding NaN or Inf in a (nested) state, or ``None``."""
    if isinstance(state, torch.Tensor):
        if state.dtype.is_floating_point or state.dtype.is_complex:
            probe = torch.view_as_real(state) if state.dtype.is_complex else state
            # In chunks: ``isfinite`` makes temporaries of its input's size (``abs``, masks),
            # which for a whole tensor is a large part of the model (issue 40: no copy on the
            # coordinator's round path).
            for chunk in probe.reshape(-1).split(_CHECK_CHUNK):
                if not bool(torch.isfinite(chunk.float() if chunk.dtype.itemsize == 1 else chunk).all()):
                    return where or "tensor"
        return None
    if isinstance(state, dict):
        items: Any = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return None
    for key, value in items:
        found = first_non_finite(value, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None


def check_not_lost(server_round: int, outcome: RoundOutcome, *, assigned: int, late: int = 0) -> None:  # type: ignore[type-arg]
    """Raises ``RoundLostError`` when a fit phase that assigned clients got no result (fresh or late).

    The reason names the first failures (escaped client text) and counts the rest.
    """
    if assigned == 0 or outcome.results or late:
        return
    failures = [
        f"{escape(f.client.name or f.client.client_id)}: {escape(f.reason)}"
        for f in outcome.failures[:_NAMED]
    ]
    more = len(outcome.failures) - len(failures)
    detail = "; ".join(failures) + (f"; {more} more" if more > 0 else "")
    raise RoundLostError(
        f"round {server_round}: all {assigned} results lost" + (f" ({detail})" if detail else "")
    )


class LostRounds:
    """Runs a round again under the same number while all its results are lost (module docstring).

    Args:
        retries: lost attempts in a row before the run stops (0: a lost round is not retried
            and the engine commits it as it did before, with no results).
        fleet: told that the lost attempt is over (``Fleet.committed``: its inputs may go).
        events: where each lost attempt is reported as ``round_failed``.
    """

    def __init__(self, retries: int, fleet: Fleet, events: EventLog) -> None:
        if retries < 0:
            raise ValueError(f"round retries must be at least 0, got {retries}")
        self.retries, self.fleet, self.events = retries, fleet, events
        #: Lost attempts so far in this process (the chaos benchmark reports them).
        self.lost = 0

    def run(self, run_round: Callable[[int], RoundMetrics], server_round: int) -> RoundMetrics:
        """``run_round(server_round)``, again while it raises ``RoundLostError``; the metrics of
        a round that needed more than one attempt hold ``ROUND_RETRIES_KEY``.

        Raises:
            RoundLostError: lost more than ``retries`` times in a row.
        """
        for attempt in itertools.count(1):
            try:
                metrics = run_round(server_round)
            except RoundLostError as exc:
                self._lost(server_round, exc, attempt)
                continue
            if attempt > 1:
                extra = {**metrics.extra, ROUND_RETRIES_KEY: float(attempt - 1)}
                metrics = dataclasses.replace(metrics, extra=extra)
            return metrics
        raise AssertionError("unreachable")

    def _lost(self, server_round: int, exc: RoundLostError, attempt: int) -> None:
        self.lost += 1
        again = attempt <= self.retries
        self.fleet.committed(server_round)  # nothing of the attempt is kept: its closed task goes
        self.events.emit("round_failed", round=server_round, reason=str(exc), attempt=attempt, retry=again)
        if not again:
            raise RoundLostError(
                f"{exc}; lost {attempt} times in a row: stopping (the last committed round stays; "
                "a restart runs this round again)"
            ) from None
        log.warning("%s: running round %d again (attempt %d)", exc, server_round, attempt + 1)
