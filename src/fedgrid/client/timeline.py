"""Where a worker's time goes: intervals of compute and of transfer, and the split of a window.

A worker's wall time between two points (in ``run_client``: the end of one fit and the end
of the next, so consecutive windows tile the worker's life) splits into:

- ``compute_s``: time some training ran (a fit, or training that goes on in the background
  while the network works: overlapped DiLoCo's steps after the send);
- ``comm_s``: time a transfer (download, upload) ran while nothing trained: the
  communication the worker *felt*. Transfers under compute are hidden and counted in
  ``transfer_s`` only;
- ``wait_s``: the rest: polling for the next task, waiting for a round to close, blocked on
  a sync that is late.

``utilization`` is ``compute_s / wall_s``. Intervals come from ``time.monotonic`` and may be
recorded from any thread (a background training thread, the runtime's network calls).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping, NamedTuple

__all__ = ["COMPUTE", "COMM", "SPLIT_KEYS", "Split", "Timeline", "measure", "union", "with_split"]

COMPUTE = "compute"
COMM = "comm"

Interval = tuple[float, float]


def union(intervals: list[Interval]) -> list[Interval]:
    """The disjoint, sorted intervals covering the same time as ``intervals``."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def measure(intervals: list[Interval], lo: float, hi: float) -> float:
    """Seconds of the disjoint ``intervals`` that lie within ``[lo, hi]``."""
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in intervals)


def _minus(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The parts of disjoint sorted ``a`` outside disjoint sorted ``b``."""
    out: list[Interval] = []
    for start, end in a:
        cursor = start
        for bs, be in b:
            if be <= cursor or bs >= end:
                continue
            if bs > cursor:
                out.append((cursor, bs))
            cursor = max(cursor, be)
        if cursor < end:
            out.append((cursor, end))
    return out


class Split(NamedTuple):
    """A window of a worker's time, in seconds (module docstring)."""

    wall_s: float
    compute_s: float
    comm_s: float
    wait_s: float
    transfer_s: float

    @property
    def utilization(self) -> float:
        # At most 1: the compute intervals lie inside the window, up to the rounding of their sum.
        return min(1.0, self.compute_s / self.wall_s) if self.wall_s > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        """As task metrics: the five fields and ``utilization``."""
        return {**self._asdict(), "utilization": self.utilization}


class Timeline:
    """The compute and transfer intervals of one worker (thread-safe).

    Args:
        clock: seconds, monotonic (``time.monotonic``; a test may pass its own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._spans: dict[str, list[Interval]] = {COMPUTE: [], COMM: []}

    def add(self, kind: str, start: float, end: float) -> None:
        """Records that ``kind`` (``COMPUTE`` or ``COMM``) ran from ``start`` to ``end``.

        Raises:
            ValueError: another kind.
        """
        if kind not in self._spans:
            raise ValueError(f"timeline kind must be {COMPUTE!r} or {COMM!r}, got {kind!r}")
        with self._lock:
            self._spans[kind].append((start, end))

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """Records the time the ``with`` block takes as ``kind``."""
        start = self.clock()
        try:
            yield
        finally:
            self.add(kind, start, self.clock())

    def split(self, lo: float, hi: float) -> Split:
        """How the window ``[lo, hi]`` splits (module docstring); forgets intervals that end before ``lo``."""
        with self._lock:
            for kind, spans in self._spans.items():
                self._spans[kind] = [s for s in spans if s[1] > lo]
            compute = union(self._spans[COMPUTE])
            comm = union(self._spans[COMM])
        wall = max(0.0, hi - lo)
        compute_s = measure(compute, lo, hi)
        felt = measure(_minus(comm, compute), lo, hi)
        return Split(
            wall_s=wall,
            compute_s=compute_s,
            comm_s=felt,
            wait_s=max(0.0, wall - compute_s - felt),
            transfer_s=measure(comm, lo, hi),
        )


#: The metrics ``Split.metrics`` gives a fit result (``fedgrid.telemetry`` sums them per round).
SPLIT_KEYS: tuple[str, ...] = (*Split._fields, "utilization")


def with_split(metrics: Mapping[str, float], split: Split) -> dict[str, float]:
    """A fit result's ``metrics`` with ``split``'s (``SPLIT_KEYS``) added.

    A result that carries all of ``SPLIT_KEYS`` already keeps its own: a region
    (``fedgrid.region``) reports the sums of its workers' splits, which are what it is upstream.
    """
    if all(key in metrics for key in SPLIT_KEYS):
        return dict(metrics)
    return {**metrics, **split.metrics()}
