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

from fedgrid.aggregation.mean import WeightedMean
from fedgrid.types import ModelState

__all__ = ["SenderMean"]


class SenderMean(WeightedMean):
    """Weighted mean per entry over the updates whose entry is not zero (Templar's sparse mean).

    ``WeightedMean``'s checks and float64 sums, plus per float tensor the summed weight of the
    updates that sent each entry."""

    weighted = True

    def __init__(self) -> None:
        super().__init__()
        self._counts: dict[str, torch.Tensor] = {}

    def add(self, update: Mapping[str, torch.Tensor], weight: float) -> None:
        """Folds one update in.

        Raises:
            ValueError: ``weight`` is not positive and finite, or the update holds other
                tensors or shapes than the first one added.
        """
        super().add(update, weight)
        for name, t in update.items():
            if t.dtype.is_floating_point:
                count = self._counts.setdefault(name, torch.zeros(t.shape, dtype=torch.float64))
                count.add_((t.detach().to("cpu") != 0).to(torch.float64), alpha=weight)

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
        super().reset()
        self._counts = {}
