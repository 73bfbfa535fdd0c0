"""``sender-mean``: per entry, the weighted mean over the updates that sent it (sparse uplinks).

A sparse codec (``sparseloco``, ``topk``) sends a few entries of each update; the others
decode as exact zeros. The plain mean counts those zeros, so an entry that one client of
``R`` sent moves the model by ``1 / R`` of that client's value, and the fewer the clients
agree on entries the smaller the step. Templar's SparseLoCo (Covenant-72B) combines sparse
pseudo-gradients with ``scatter_reduce(..., reduce="mean", include_self=False)``: each entry
is the mean over the workers that sent it. ``SenderMean`` is that rule, weighted:

    out[i] = sum_c w_c x_c[i] / sum_{c : x_c[i] != 0} w_c        (0 where no update sent i)

It equals the weighted mean when every update is dense (no exact zeros). Integer and bool
tensors take the weighted mean over all updates, rounded to nearest (``WeightedMean``'s rule).
Streaming: memory is two float64 accumulators per tensor, whatever the number of updates.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping

import torch

from fedgrid.aggregation.base import Aggregator
from fedgrid.types import ModelState

__all__ = ["SenderMean"]


class SenderMean(Aggregator):
    """Weighted mean per entry over the updates whose entry is not zero (Templar's sparse mean)."""

    weighted = True

    def __init__(self) -> None:
        self._sums: OrderedDict[str, torch.Tensor] | None = None
        self._counts: dict[str, torch.Tensor] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self._total = 0.0

    def add(self, update: Mapping[str, torch.Tensor], weight: float) -> None:
        """Folds one update in.

        Raises:
            ValueError: ``weight`` is not positive and finite, or the update holds other
                tensors or shapes than the first one added.
        """
        if not (weight > 0 and weight != float("inf")):
            raise ValueError(f"weight must be positive and finite, got {weight}")
        if self._sums is None:
            self._sums = OrderedDict()
            for name, t in update.items():
                self._dtypes[name] = t.dtype
                self._sums[name] = torch.zeros(t.shape, dtype=torch.float64)
                if t.dtype.is_floating_point:
                    self._counts[name] = torch.zeros(t.shape, dtype=torch.float64)
        elif list(update) != list(self._sums):
            raise ValueError("update holds different tensors than the first one added")
        for name, t in update.items():
            acc = self._sums[name]
            if t.shape != acc.shape:
                raise ValueError(f"tensor '{name}': shape {list(t.shape)} differs from {list(acc.shape)}")
            value = t.detach().to("cpu")
            acc.add_(value, alpha=weight)
            if name in self._counts:
                self._counts[name].add_((value != 0).to(torch.float64), alpha=weight)
        self._total += weight

    def result(self) -> ModelState:
        """The per-entry mean over senders; consumes the accumulators.

        Raises:
            ValueError: nothing was added.
        """
        if self._sums is None:
            raise ValueError("no update was added")
        out: ModelState = OrderedDict()
        for name, acc in self._sums.items():
            dtype = self._dtypes[name]
            count = self._counts.get(name)
            if count is None:
                out[name] = acc.div_(self._total).round_().to(dtype)
            else:
                out[name] = torch.where(count > 0, acc / count.clamp_min(1e-300), 0.0).to(dtype)
        self.reset()
        return out

    def reset(self) -> None:
        self._sums, self._counts, self._dtypes, self._total = None, {}, {}, 0.0
