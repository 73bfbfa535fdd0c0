"""The weighted mean: FedAvg's arithmetic and the default aggregator of every strategy.

Streaming (``add`` then ``result``), so memory stays O(model size) however many updates
are added.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping, Sequence

import torch

from fedgrid.aggregation.base import Aggregator
from fedgrid.errors import InterruptedRunError
from fedgrid.interrupts import stopping
from fedgrid.types import ModelState

__all__ = ["WeightedMean", "Mean", "weighted_mean", "weighted_mean_of_rows"]


class WeightedMean(Aggregator):
    """Example-weighted mean.

    Accumulates in float64 (complex128 for complex tensors), in place and without
    temporaries, so averaging n copies of a model gives it back exactly; callers fold
    updates in a canonical order, which makes the result reproducible bit for bit. To keep
    memory low, aggregate tensor by tensor (as ``FedAvg`` does): the accumulator is then
    twice one tensor, not twice the model. Floating tensors are cast back to their dtype;
    integer and bool tensors (e.g. BatchNorm's ``num_batches_tracked``) take the weighted
    mean rounded to nearest.
    """

    def __init__(self) -> None:
        self._sums: OrderedDict[str, torch.Tensor] | None = None
        self._dtypes: dict[str, torch.dtype] = {}
        self._total = 0.0

    def add(self, update: Mapping[str, torch.Tensor], weight: float) -> None:
        """Folds in ``update``; gives up (``InterruptedRunError``) once the process is stopping
        (``fedgrid.interrupts.stopping``): an aggregate of a large model stops between two adds."""
        if stopping():
            raise InterruptedRunError("aggregation given up: the process is stopping")
        if not (weight > 0 and weight != float("inf")):
            raise ValueError(f"weight must be positive and finite, got {weight}")
        if self._sums is None:
            self._sums = OrderedDict()
            for name, t in update.items():
                self._dtypes[name] = t.dtype
                self._sums[name] = torch.zeros(t.shape, dtype=_accumulator_dtype(t.dtype))
        elif list(update) != list(self._sums):
            raise ValueError("update holds different tensors than the first one added")
        for name, t in update.items():
            acc = self._sums[name]
            if t.shape != acc.shape:
                raise ValueError(f"tensor '{name}': shape {list(t.shape)} differs from {list(acc.shape)}")
            acc.add_(t.detach().to("cpu"), alpha=weight)  # mixed dtypes are cast element-wise, no copy
        self._total += weight

    def result(self) -> ModelState:
        """The mean; consumes the accumulators (``add`` starts a new mean afterwards)."""
        if self._sums is None:
            raise ValueError("no update was added")
        out: ModelState = OrderedDict()
        for name, acc in self._sums.items():
            mean = acc.div_(self._total)  # in place: no second accumulator-sized temporary
            dtype = self._dtypes[name]
            if not (dtype.is_floating_point or dtype.is_complex):
                mean = mean.round_()
            out[name] = mean.to(dtype)
        self.reset()  # the accumulators were consumed
        return out

    def reset(self) -> None:
        self._sums, self._dtypes, self._total = None, {}, 0.0


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype.is_complex else torch.float64


def weighted_mean(updates: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> ModelState:
    """The weighted mean of ``updates`` (pure function over ``WeightedMean``)."""
    agg = WeightedMean()
    for update, weight in zip(updates, weights, strict=True):
        agg.add(update, weight)
    return agg.result()


def _row_of(t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """``(stack, i)`` when ``t`` is ``stack[i]`` of a contiguous stack, else ``None``."""
    stack = t._base
    if (
        stack is None
        or not stack.is_contiguous()
        or stack.dim() != t.dim() + 1
        or stack.shape[1:] != t.shape
        or not t.is_contiguous()
    ):
        return None
    offset = t.storage_offset() - stack.storage_offset()
    size = max(t.numel(), 1)
    if offset % size:
        return None
    return stack, offset // size


def weighted_mean_of_rows(
    tensors: Sequence[torch.Tensor], weights: Sequence[float], *, slice_elements: int = 1 << 18
) -> torch.Tensor | None:
    """The weighted mean of ``tensors`` when each is a row of a stacked tensor (the batched
    simulation engine's outputs: K clients' models stacked along dim 0); ``None`` when one is not.

    Each stack is reduced at once: a float64 matrix-vector product of its rows (those in
    ``tensors``) with their weights, slice by slice (``slice_elements`` float64 elements of
    rows at a time: 2 MiB, which stays in cache). The sum's order within a stack is the BLAS
    kernel's, not the order of ``tensors``, so the result equals ``weighted_mean``'s
    within float64 rounding before the cast (the batched engine's results are equal to a
    deployment's within a tolerance anyway, ``fedgrid.determinism.BATCHED_ATOL``).
    Floating and integer tensors only (integers rounded to nearest, as ``WeightedMean``).

    Raises:
        ValueError: a weight that is not positive and finite.
    """
    if not tensors:
        return None
    first = tensors[0]
    if first.is_complex() or first.device.type != "cpu":
        return None
    groups: dict[int, tuple[torch.Tensor, list[int], list[float]]] = {}
    for t, w in zip(tensors, weights, strict=True):
        if not (w > 0 and w != float("inf")):
            raise ValueError(f"weight must be positive and finite, got {w}")
        found = (
            _row_of(t)
            if t.dtype == first.dtype and t.shape == first.shape and t.device == first.device
            else None
        )
        if found is None:
            return None
        stack, row = found
        group = groups.setdefault(id(stack), (stack, [], []))
        group[1].append(row)
        group[2].append(float(w))
    numel = first.numel()
    total = torch.zeros(numel, dtype=torch.float64)
    for stack, rows, ws in groups.values():
        flat = stack.reshape(stack.shape[0], numel)
        order = sorted(
            range(len(rows)), key=rows.__getitem__
        )  # stack order: every row of a stack needs no gather
        rows, ws = [rows[i] for i in order], [ws[i] for i in order]
        picked = flat if rows == list(range(flat.shape[0])) else flat.index_select(0, torch.tensor(rows))
        row_weights = torch.tensor(ws, dtype=torch.float64)
        step = max(1, slice_elements // len(rows))
        for start in range(0, numel, step):
            part = picked[:, start : start + step].to(torch.float64)
            total[start : start + part.shape[1]].addmv_(part.t(), row_weights)
    mean = total.div_(sum(float(w) for w in weights))
    if not first.dtype.is_floating_point:
        mean = mean.round_()
    return mean.to(first.dtype).view(first.shape)


class Mean(WeightedMean):
    """The ``mean`` aggregator: ``WeightedMean``, optionally ignoring the weights.

    Args:
        weighted: weight each update by its client's example count (FedAvg). With
            ``False`` every update counts once, so a client cannot buy influence by
            reporting more examples.

    Memory: O(model size), whatever the number of updates.
    """

    def __init__(self, *, weighted: bool = True) -> None:
        super().__init__()
        self.weighted = weighted

    def add(self, update: Mapping[str, torch.Tensor], weight: float) -> None:
        if not (weight > 0 and weight != float("inf")):
            raise ValueError(f"weight must be positive and finite, got {weight}")
        super().add(update, weight if self.weighted else 1.0)
