"""Clipping aggregators: bound each update's influence by its L2 norm.

Both take *updates* (deltas from the global model): a norm bound on whole models would
be meaningless. The norm of an update is the L2 norm over all its floating tensors
together, computed in float64; integer and bool tensors are neither counted nor clipped.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from typing import Mapping

import torch

from fedgrid.aggregation.mean import WeightedMean
from fedgrid.aggregation.robust import BufferedAggregator, cast_back, check_weight
from fedgrid.types import ModelState

__all__ = ["NormClip", "CenteredClip", "update_norm"]


def update_norm(update: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of ``update`` over all its real floating tensors, in float64."""
    total = 0.0
    for t in update.values():
        if t.dtype.is_floating_point:
            total += float(t.detach().to(torch.float64).square().sum())
    return math.sqrt(total)


class NormClip(WeightedMean):
    """Scale each update down to L2 norm at most ``bound``, then take the weighted mean.

    An update with norm ``r > bound`` is multiplied by ``bound / r``; shorter updates pass
    unchanged. With a fixed ``bound`` it streams: memory O(model size), however many
    updates are added.

    Without a ``bound`` (the default) the bound is the median norm of the round's updates,
    recomputed each round: adaptive clipping (Sun et al. 2019, "Can You Really Backdoor
    Federated Learning?", bound the update norm; Andrew et al. 2021, "Differentially Private
    Learning with Adaptive Clipping", set the bound to a quantile of the norms, here the
    median of the round itself). Why the median: a fixed default cannot know the scale
    of an update, which grows with the model, the learning rate and the local epochs (the
    digits MLP's updates are about 1-5 long, a CNN's far more), so any constant either
    clips nothing or clips every honest update; and fewer than half of the updates cannot
    move the median beyond the norms of the others, so Byzantine clients in a minority
    cannot raise the bound to let a large update through. About half of the updates are
    scaled down each round. This mode buffers the round's updates (memory: n x model size,
    as ``median``); ``last_bound`` is the bound it used.

    Args:
        bound: the largest norm an update keeps (> 0), or ``None`` for the median norm.
        weighted: weight by example counts (the default, as FedAvg); a client lying about
            its count still moves the mean by at most ``bound``-sized steps times its share.

    Raises:
        ValueError: ``bound`` is given and not positive and finite.
    """

    name = "norm-clip"

    def __init__(self, *, bound: float | None = None, weighted: bool = True) -> None:
        if bound is not None and not (bound > 0 and bound != float("inf")):
            raise ValueError(f"bound must be positive and finite, got {bound}")
        super().__init__()
        self.bound = None if bound is None else float(bound)
        self.weighted = weighted
        #: The bound applied to the latest result (the fixed one, or that round's median norm).
        self.last_bound: float | None = self.bound
        self._pending: list[
            tuple[Mapping[str, torch.Tensor], float, float]
        ] = []  # adaptive: (update, weight, norm)

    def add(self, update: Mapping[str, torch.Tensor], weight: float) -> None:
        check_weight(weight)
        if self.bound is None:
            if self._pending:  # the checks WeightedMean.add makes, now rather than at result()
                first = self._pending[0][0]
                if list(update) != list(first):
                    raise ValueError("update holds different tensors than the first one added")
                for name, t in update.items():
                    if t.shape != first[name].shape:
                        raise ValueError(
                            f"tensor '{name}': shape {list(t.shape)} differs from {list(first[name].shape)}"
                        )
            self._pending.append(
                (
                    OrderedDict((k, v.detach().to("cpu")) for k, v in update.items()),
                    weight,
                    update_norm(update),
                )
            )
            return
        self._add_clipped(update, weight, update_norm(update), self.bound)

    def _add_clipped(
        self, update: Mapping[str, torch.Tensor], weight: float, norm: float, bound: float
    ) -> None:
        if norm > bound:
            scale = bound / norm
            update = OrderedDict(
                (k, (v.to(torch.float64) * scale).to(v.dtype) if v.dtype.is_floating_point else v)
                for k, v in update.items()
            )
        super().add(update, weight if self.weighted else 1.0)

    def result(self) -> ModelState:
        if self.bound is None:
            if not self._pending:
                raise ValueError("no update was added")
            pending, self._pending = self._pending, []
            bound = statistics.median(norm for _, _, norm in pending)
            # All-zero updates have median 0: nothing to scale, and 0 would divide below.
            self.last_bound = bound
            for update, weight, norm in pending:  # in order of add: the canonical order
                self._add_clipped(update, weight, norm, bound if bound > 0 else float("inf"))
        return super().result()

    def reset(self) -> None:
        super().reset()
        self._pending = []


class CenteredClip(BufferedAggregator):
    """Centered clipping (Karimireddy, He and Jaggi 2021, "Learning from History ...").

    Starting from ``v = 0`` (the current global model, since updates are deltas from it),
    repeat ``iterations`` times::

        v <- v + sum_i w_i * (x_i - v) * min(1, tau / ||x_i - v||) / sum_i w_i

    Each update pulls the center by at most ``tau``, so a few huge updates cannot drag it
    far. The paper starts from the previous round's aggregate (worker momentum); with
    deltas the global model is the natural, stateless center.

    Args:
        tau: clipping radius (> 0).
        iterations: clipping iterations (>= 1).
        weighted: see ``BufferedAggregator`` (default: every update counts once).

    Memory: see ``BufferedAggregator``, plus the float64 center (one model).
    """

    name = "centered-clip"

    def __init__(self, *, tau: float = 10.0, iterations: int = 5, weighted: bool = False) -> None:
        if not (tau > 0 and tau != float("inf")):
            raise ValueError(f"tau must be positive and finite, got {tau}")
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"iterations must be a positive integer, got {iterations!r}")
        super().__init__(weighted=weighted)
        self.tau = float(tau)
        self.iterations = iterations

    def _combine(self) -> ModelState:
        first = self._updates[0]
        names = [n for n, t in first.items() if t.dtype.is_floating_point]
        center = {n: torch.zeros(first[n].shape, dtype=torch.float64) for n in names}
        weights = torch.tensor(self._weights, dtype=torch.float64)
        for _ in range(self.iterations):
            sq = torch.zeros(len(self._updates), dtype=torch.float64)
            for n in names:
                diff = self._stack(n) - center[n]
                sq += diff.reshape(len(self._updates), -1).square().sum(dim=1)
            norms = sq.sqrt()
            scale = torch.where(norms > self.tau, self.tau / norms.clamp(min=1e-300), torch.ones_like(norms))
            coef = weights * scale / weights.sum()
            for n in names:
                diff = self._stack(n) - center[n]
                center[n] = center[n] + (diff * coef.reshape((-1,) + (1,) * (diff.dim() - 1))).sum(dim=0)
        out: ModelState = OrderedDict()
        for n, t in first.items():
            if n in center:
                out[n] = cast_back(center[n], t.dtype)
            else:  # integer buffers are not clipped: their weighted mean
                stacked = self._stack(n)
                out[n] = cast_back(
                    (stacked * self._weights_like(stacked)).sum(dim=0) / weights.sum(), t.dtype
                )
        return out
