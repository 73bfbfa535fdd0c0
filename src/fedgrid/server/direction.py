"""The direction of each update against a robust reference: its cosine with the coordinate-wise
median of a round's fresh updates (``Influence``'s direction check, ``server/influence.py``).

Pure: tensors in, floats out. Each tensor of the median is the lower median, coordinate by
coordinate, of the fresh updates' differences (``torch.median`` over the stacked updates: an
actual update's value at every coordinate, the same on every machine); the dot products and
norms are summed in float64 in the order of the names given. With an honest majority, each
coordinate of the median lies between two honest values, so it points where the honest updates
point, whatever one update holds; an update whose cosine with it is negative points away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

__all__ = ["MedianGeometry", "difference", "median_geometry"]


def difference(
    name: str, value: torch.Tensor, base: Mapping[str, torch.Tensor], *, delta: bool
) -> torch.Tensor:
    """``value``'s difference from ``base[name]`` in at least float32: ``value`` as it is for a
    delta result, or where ``base`` lacks the tensor or has another shape (as ``update_distance``)."""
    dtype = torch.promote_types(value.dtype, torch.float32)
    ref = base.get(name)
    if delta or ref is None or ref.shape != value.shape:
        return value.to(dtype)
    return value.to(dtype) - ref.to(dtype)


@dataclass(frozen=True)
class MedianGeometry:
    """Each update against the coordinate-wise median of the fresh ones, in the order given."""

    #: The cosine of each update with the median (``nan`` for an update of norm 0).
    cosines: list[float]
    #: The L2 distance of each update from the median.
    deviations: list[float]


def median_geometry(
    names: Sequence[str],
    fresh: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor], bool]],
    others: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor], bool]] = (),
) -> MedianGeometry | None:
    """Each update of ``fresh`` then ``others`` against the coordinate-wise median of the
    ``fresh`` ones, over the tensors ``names``: its cosine with it and its distance from it. An update is ``(state, base, delta)``: its
    tensors, the model its task sent, and whether its tensors are differences already. One
    tensor at a time: the memory held beyond the updates is the fresh ones' stack of one tensor.

    Returns:
        The cosines and distances, or ``None`` where the median is 0 (every coordinate's
        median is 0: no direction to measure against).
    """
    updates = list(fresh) + list(others)
    dots = [0.0] * len(updates)
    norms = [0.0] * len(updates)
    reference = 0.0
    for name in names:  # |u - m|^2 = |u|^2 - 2 u.m + |m|^2, each summed in float64
        stack = torch.stack([difference(name, s[name], b, delta=d) for s, b, d in fresh])
        median = stack.median(dim=0).values.double().ravel()
        reference += float(median.dot(median))
        for i, (state, base, delta) in enumerate(updates):
            value = (
                (stack[i] if i < len(fresh) else difference(name, state[name], base, delta=delta))
                .double()
                .ravel()
            )
            dots[i] += float(value.dot(median))
            norms[i] += float(value.dot(value))
    if reference == 0.0:
        return None
    return MedianGeometry(
        cosines=[
            dot / math.sqrt(norm * reference) if norm > 0 else math.nan for dot, norm in zip(dots, norms)
        ],
        deviations=[math.sqrt(max(0.0, norm - 2 * dot + reference)) for dot, norm in zip(dots, norms)],
    )
