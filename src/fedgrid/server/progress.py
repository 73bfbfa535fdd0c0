"""A client's progress inside its task, as its heartbeats report it (``TaskProgress`` in the
protocol), checked before it is kept for the status page.

Each figure must be finite and at least 0 (``eta_s`` may also be -1: unknown), ``steps_done``
at most ``steps_total`` when that is given, and under the bounds below; a heartbeat that breaks
one is refused (``InvalidUpdateError``: INVALID_ARGUMENT naming the field) and changes nothing.
"""

from __future__ import annotations

import math
from typing import Any

from fedgrid.errors import InvalidUpdateError

__all__ = ["MAX_STEPS", "MAX_RATE", "MAX_ETA_S", "check_progress"]

#: The most steps a task reports.
MAX_STEPS = 10**12
#: The most examples or tokens per second.
MAX_RATE = 1e12
#: The most seconds left (115 days).
MAX_ETA_S = 1e7


def check_progress(message: Any) -> dict[str, float | int]:
    """The fields of a ``TaskProgress`` message as a dict for ``/api/status``.

    Raises:
        InvalidUpdateError: a field out of its range, named with its value.
    """
    round_, done, total = int(message.round), int(message.steps_done), int(message.steps_total)
    for name, value in (("steps_done", done), ("steps_total", total)):
        if value > MAX_STEPS:
            raise InvalidUpdateError(f"progress.{name} {value} is over {MAX_STEPS}")
    if total and done > total:
        raise InvalidUpdateError(f"progress.steps_done {done} is over its steps_total {total}")
    rates = {"examples_per_s": float(message.examples_per_s), "tokens_per_s": float(message.tokens_per_s)}
    for name, rate in rates.items():
        if not (math.isfinite(rate) and 0.0 <= rate <= MAX_RATE):
            raise InvalidUpdateError(f"progress.{name} {rate!r} is not a finite number in [0, {MAX_RATE:g}]")
    eta = float(message.eta_s)
    if not (math.isfinite(eta) and (eta == -1.0 or 0.0 <= eta <= MAX_ETA_S)):
        raise InvalidUpdateError(f"progress.eta_s {eta!r} is neither -1 (unknown) nor in [0, {MAX_ETA_S:g}]")
    return {
        "round": round_,
        "steps_done": done,
        "steps_total": total,
        **{name: round(rate, 3) for name, rate in rates.items()},
        "eta_s": round(eta, 1),
    }
