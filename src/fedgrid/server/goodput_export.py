"""The goodput export of a coordinator's monitor: each fit result's split of its window
(``compute_s``, ``comm_s``, ``wait_s``: ``fedgrid.client.timeline``) into the
``fedgrid_task_seconds`` and ``fedgrid_task_utilization`` histograms by region, and each
client's last split for ``/api/status`` (its ``clients`` columns and the ``regions`` rows).

A ``region`` label is one a client joined with (printable, at most 64 characters, checked at
Join), for the first ``MAX_REGION_LABELS`` distinct ones, ``other`` after them: a client
cannot grow the series without bound. The splits kept are bounded too (the most recent
clients to report, as many as ``CoordinatorMonitor`` keeps).
"""

from __future__ import annotations

from typing import Any, Sequence

from fedgrid.telemetry import utilization_of
from fedgrid.types import ClientInfo, FitRes

__all__ = ["GoodputExport", "region_rows", "MAX_REGION_LABELS", "SPLIT_FIELDS"]

#: Distinct ``region`` label values of the goodput histograms; a later region is ``other``.
MAX_REGION_LABELS = 16
#: The parts of a fit result's window that ``fedgrid_task_seconds`` counts.
_TASK_PARTS = ("compute", "comm", "wait")
#: What ``/api/status`` shows of a client's last fit split.
SPLIT_FIELDS = ("compute_s", "comm_s", "wait_s", "wall_s", "utilization")
_UTILIZATION_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0, float("inf"))


class GoodputExport:
    """The goodput histograms of one coordinator and its clients' last fit splits.

    Not thread-safe: the monitor calls it holding its own lock.

    Args:
        prom: the ``prometheus_client`` module.
        registry: the coordinator's ``CollectorRegistry``.
        seconds_buckets: the buckets of ``fedgrid_task_seconds``.
        keep: clients whose last fit split is kept (the most recent to report).
    """

    def __init__(self, prom: Any, registry: Any, *, seconds_buckets: Sequence[float], keep: int) -> None:
        self.task_seconds = prom.Histogram(
            "fedgrid_task_seconds",
            "a fit result's window: seconds of compute, felt communication or waiting",
            ["part", "region"],
            buckets=seconds_buckets,
            registry=registry,
        )
        self.task_utilization = prom.Histogram(
            "fedgrid_task_utilization",
            "a fit result's compute over its window's wall time",
            ["region"],
            buckets=_UTILIZATION_BUCKETS,
            registry=registry,
        )
        self._keep = keep
        self._splits: dict[str, dict[str, float]] = {}  # client id -> its last fit split
        self._regions: set[str] = set()  # the region label values in use

    def observe(self, results: Sequence[FitRes]) -> None:
        """Counts the splits of ``results`` (those that carry one) and keeps each client's last."""
        for result in results:
            m = result.metrics
            if not all(key in m for key in SPLIT_FIELDS):
                continue  # a client that reports no split
            cid = result.client.client_id
            self._splits.pop(cid, None)  # to the end: the dict runs from least to most recent
            self._splits[cid] = {key: float(m[key]) for key in SPLIT_FIELDS}
            if len(self._splits) > self._keep:
                del self._splits[next(iter(self._splits))]
            region = self._region_label(result.client.region)
            for part in _TASK_PARTS:
                self.task_seconds.labels(part=part, region=region).observe(float(m[f"{part}_s"]))
            self.task_utilization.labels(region=region).observe(float(m["utilization"]))

    def _region_label(self, region: str) -> str:
        if region in self._regions or len(self._regions) < MAX_REGION_LABELS:
            self._regions.add(region)
            return region
        return "other"

    def splits_of(self, live: set[str]) -> dict[str, dict[str, float]]:
        """The last splits of the clients in ``live`` (a copy); those of the others are forgotten."""
        for gone in [cid for cid in self._splits if cid not in live]:  # bounded by the membership
            del self._splits[gone]
        return dict(self._splits)


def region_rows(
    records: Sequence[tuple[ClientInfo, float, str, int]], splits: dict[str, dict[str, float]]
) -> list[dict[str, Any]]:
    """The ``regions`` of ``/api/status``: per region label, the sums of its clients' last fit
    splits and their utilization (summed compute over summed wall), for clients that have one."""
    sums: dict[str, dict[str, float]] = {}
    counts: dict[str, int] = {}
    for info, *_ in records:
        split = splits.get(info.client_id)
        if split is None:
            continue
        total = sums.setdefault(info.region, dict.fromkeys(("compute_s", "comm_s", "wait_s", "wall_s"), 0.0))
        for key in total:
            total[key] += split[key]
        counts[info.region] = counts.get(info.region, 0) + 1
    return [
        {
            "region": region,
            "clients": counts[region],
            **total,
            "utilization": utilization_of(total["compute_s"], total["wall_s"]),
        }
        for region, total in sorted(sums.items())
    ]
