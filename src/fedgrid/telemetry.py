"""Timing telemetry: a round's goodput, where its workers' time went, summed over the round's fit
results: timing metrics, which the coordinator and a region report beside the model's, not model
aggregation (it lived in ``fedgrid.aggregation`` before).

Every fit result a deployed client uploads carries the split of its window
(``fedgrid.client.timeline``: from the end of its previous fit to the end of this one) as
metrics: ``compute_s``, ``comm_s``, ``wait_s``, ``wall_s``, ``transfer_s`` and
``utilization``. A round's aggregate is their sums, and ``utilization`` the ratio of the sums
(compute over wall), never an example-weighted mean: a worker's weight in the model says
nothing of how long it worked. A region (``fedgrid.region``) reports the sums of its own
workers' splits, so it counts as one learner whose seconds are its workers'.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from fedgrid.types import FitRes

__all__ = [
    "SPLIT_KEYS",
    "SUMMED_KEYS",
    "WORKER_WALL_S",
    "goodput_metrics",
    "utilization_of",
    "without_timing",
]

#: The metrics of a fit result's split (``fedgrid.client.timeline.SPLIT_KEYS``).
SPLIT_KEYS = ("wall_s", "compute_s", "comm_s", "wait_s", "transfer_s", "utilization")
#: The split's seconds a round sums under the same names (its ``wall_s`` is the round's own).
SUMMED_KEYS = ("compute_s", "comm_s", "wait_s", "transfer_s")
#: The round metric that sums the workers' ``wall_s``.
WORKER_WALL_S = "worker_wall_s"


def utilization_of(compute_s: float, wall_s: float) -> float:
    """``compute_s / wall_s`` (at most 1: compute lies inside the window, up to rounding), 0 for an
    empty window."""
    return min(1.0, compute_s / wall_s) if wall_s > 0 else 0.0


def goodput_metrics(results: Sequence[FitRes]) -> dict[str, float]:
    """A round's goodput from its fit results (module docstring).

    Only results carrying the whole split count (a client of another build may send none).
    Sums run in the canonical order of the results' clients, so equal inputs give equal bits.

    Returns:
        ``{}`` when no result carries the split; else ``compute_s``, ``comm_s``, ``wait_s``,
        ``transfer_s`` and ``worker_wall_s`` (sums), ``utilization`` (summed compute over
        summed wall), and ``utilization.REGION`` for each non-empty region label among them.
    """
    timed = [r for r in sorted(results, key=lambda r: r.client.sort_key) if _has_split(r.metrics)]
    if not timed:
        return {}
    out = _sums([r.metrics for r in timed])
    for region in sorted({r.client.region for r in timed if r.client.region}):
        part = _sums([r.metrics for r in timed if r.client.region == region])
        out[f"utilization.{region}"] = part["utilization"]
    return out


def _has_split(metrics: Mapping[str, float]) -> bool:
    return all(key in metrics for key in SPLIT_KEYS)


def _sums(splits: Sequence[Mapping[str, float]]) -> dict[str, float]:
    out = {key: sum(float(m[key]) for m in splits) for key in SUMMED_KEYS}
    out[WORKER_WALL_S] = sum(float(m["wall_s"]) for m in splits)
    out["utilization"] = utilization_of(out["compute_s"], out[WORKER_WALL_S])
    return out


def without_timing(metrics: Mapping[str, object]) -> dict[str, object]:
    """``metrics`` (a fit result's, or a ``metrics.jsonl`` row) without its wall-clock
    measurements: the split, the round's sums and ratios and the round's own ``wall_s``.

    What two runs equal bit for bit (same seed, same threads; simulation and deployment)
    still differ in: compare the rest.
    """
    timing = {*SPLIT_KEYS, *SUMMED_KEYS, WORKER_WALL_S}
    return {k: v for k, v in metrics.items() if k not in timing and not k.startswith("utilization.")}
