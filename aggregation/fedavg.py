"""Federated averaging (McMahan et al. 2017): the example-weighted mean of client models."""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import torch

from fedgrid.aggregation.base import Aggregator, Strategy, weighted_metrics
from fedgrid.seeding import derive_seed
from fedgrid.types import ClientInfo, EvaluateIns, FitIns, FitRes, Failure, ModelState, Scalar

__all__ = ["WeightedMean", "FedAvg", "weighted_mean"]


class WeightedMean(Aggregator):
    """Example-weighted mean, accumulated in float64 so the result barely depends on order.

    Floating tensors are averaged and cast back to their dtype; integer and bool tensors
    (e.g. BatchNorm's ``num_batches_tracked``) take the weighted mean rounded to nearest.
    """

    def __init__(self) -> None:
        self._sums: OrderedDict[str, torch.Tensor] | None = None
        self._dtypes: dict[str, torch.dtype] = {}
        self._total = 0.0

    def add(self, update: Mapping[str, torch.Tensor], weight: float) -> None:
        if not (weight > 0 and weight != float("inf")):
            raise ValueError(f"weight must be positive and finite, got {weight}")
        if self._sums is None:
            self._sums = OrderedDict()
            for name, t in update.items():
                self._dtypes[name] = t.dtype
                acc_dtype = torch.complex128 if t.dtype.is_complex else torch.float64
                self._sums[name] = torch.zeros(t.shape, dtype=acc_dtype)
        elif list(update) != list(self._sums):
            raise ValueError("update holds different tensors than the first one added")
        for name, t in update.items():
            acc = self._sums[name]
            if t.shape != acc.shape:
                raise ValueError(f"tensor '{name}': shape {list(t.shape)} differs from {list(acc.shape)}")
            acc.add_(t.detach().to("cpu", acc.dtype), alpha=weight)
        self._total += weight

    def result(self) -> ModelState:
        if self._sums is None:
            raise ValueError("no update was added")
        out: ModelState = OrderedDict()
        for name, acc in self._sums.items():
            mean = acc / self._total
            dtype = self._dtypes[name]
            if not (dtype.is_floating_point or dtype.is_complex):
                mean = mean.round()
            out[name] = mean.to(dtype)
        return out

    def reset(self) -> None:
        self._sums, self._dtypes, self._total = None, {}, 0.0


def weighted_mean(updates: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> ModelState:
    """The weighted mean of ``updates`` (pure function over ``WeightedMean``)."""
    agg = WeightedMean()
    for update, weight in zip(updates, weights, strict=True):
        agg.add(update, weight)
    return agg.result()


class FedAvg(Strategy):
    """Broadcast the global model, clients train, average their models by examples.

    Args:
        fraction_fit: share of live clients asked each round (at least ``min_fit_clients``).
        min_fit_clients: fewest clients a round asks.
        fraction_evaluate: share of live clients asked to evaluate each new global model on
            their own data (federated evaluation); 0 turns it off.
        seed: seeds client sampling, so a run's selection is reproducible.
        fit_config: scalars sent with every task (``local_epochs``, ``lr``, ...).
    """

    def __init__(
        self,
        *,
        fraction_fit: float = 1.0,
        min_fit_clients: int = 1,
        fraction_evaluate: float = 0.0,
        seed: int = 0,
        fit_config: Mapping[str, Scalar] | None = None,
    ) -> None:
        if not 0.0 < fraction_fit <= 1.0:
            raise ValueError(f"fraction_fit must be in (0, 1], got {fraction_fit}")
        if min_fit_clients < 1:
            raise ValueError(f"min_fit_clients must be at least 1, got {min_fit_clients}")
        if not 0.0 <= fraction_evaluate <= 1.0:
            raise ValueError(f"fraction_evaluate must be in [0, 1], got {fraction_evaluate}")
        self.fraction_fit = fraction_fit
        self.fraction_evaluate = fraction_evaluate
        self.min_fit_clients = min_fit_clients
        self.seed = seed
        self.fit_config = dict(fit_config or {})
        self._state: ModelState | None = None

    def initialize(self, *, initial_state: ModelState) -> None:
        self._state = OrderedDict((k, v.detach().clone()) for k, v in initial_state.items())

    @property
    def global_state(self) -> ModelState:
        if self._state is None:
            raise RuntimeError("strategy has no global model: call initialize() first")
        return self._state

    def _sample(self, clients: Sequence[ClientInfo], fraction: float, server_round: int, salt: int) -> list[ClientInfo]:
        ordered = sorted(clients, key=lambda c: c.sort_key)
        count = min(max(self.min_fit_clients, int(fraction * len(ordered))), len(ordered))  # floor, as Flower
        if count < len(ordered):
            rng = random.Random(derive_seed("sample", self.seed, server_round, salt))
            ordered = sorted(rng.sample(ordered, count), key=lambda c: c.sort_key)
        return ordered

    def configure_round(self, *, server_round: int, clients: Sequence[ClientInfo]) -> list[tuple[ClientInfo, FitIns]]:
        ins = FitIns(round=server_round, config={**self.fit_config, "round": server_round, "seed": self.seed})
        return [(client, ins) for client in self._sample(clients, self.fraction_fit, server_round, 0)]

    def configure_evaluate(self, *, server_round: int, clients: Sequence[ClientInfo]) -> list[tuple[ClientInfo, EvaluateIns]]:
        if self.fraction_evaluate == 0.0:
            return []
        ins = EvaluateIns(round=server_round, config={"round": server_round, "seed": self.seed})
        return [(client, ins) for client in self._sample(clients, self.fraction_evaluate, server_round, 1)]

    def aggregate(self, *, server_round: int, results: Sequence[FitRes], failures: Sequence[Failure]) -> dict[str, float]:
        if not results:
            return {}
        agg = WeightedMean()
        ordered = sorted(results, key=lambda r: r.client.sort_key)  # canonical order
        for res in ordered:
            agg.add(res.state, float(res.num_examples))
        self._state = agg.result()
        train = weighted_metrics([(r.num_examples, {"loss": r.metrics["loss"]}) for r in ordered if "loss" in r.metrics])
        return {"train_loss": train["loss"]} if train else {}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.initialize(initial_state=state["global_state"])
        self.seed = int(state.get("seed", self.seed))
