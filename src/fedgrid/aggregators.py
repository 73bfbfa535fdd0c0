"""Aggregators: the arithmetic that turns a round's updates into one (streaming means, and the
robust ones that need every update at once: median, trimmed mean, Krum, clipping).

Names are imported on first access (``fedgrid.lazy``); they are defined in ``fedgrid.aggregation``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedgrid.lazy import exports

__all__ = [
    "Aggregator",
    "WeightedMean",
    "Mean",
    "weighted_mean",
    "Median",
    "TrimmedMean",
    "Krum",
    "MultiKrum",
    "NormClip",
    "CenteredClip",
    "AGGREGATORS",
    "build_aggregator",
]

__getattr__, __dir__ = exports(__name__, dict.fromkeys(__all__, "fedgrid.aggregation"), globals_=globals())

if TYPE_CHECKING:  # what type checkers and IDEs see; never executed
    from fedgrid.aggregation import (
        AGGREGATORS,
        Aggregator,
        CenteredClip,
        Krum,
        Mean,
        Median,
        MultiKrum,
        NormClip,
        TrimmedMean,
        WeightedMean,
        build_aggregator,
        weighted_mean,
    )
