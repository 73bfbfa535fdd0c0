"""Federated averaging (McMahan et al. 2017): the example-weighted mean of client models.

``FedAvg`` is also the base of the other built-in strategies: canonical result order,
checkpoints, and ``_update_subset``, the one place where results become new values of (part
of) the global model. Which clients a round asks is its ``Sampling``
(``fedgrid.aggregation.selection``), held rather than inherited.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import Any, ClassVar, Mapping, Sequence

import torch

from fedgrid.aggregation.base import AggregationPreconditionError, Aggregator, Strategy, weighted_metrics
from fedgrid.aggregation.lora import LORA_AGGREGATIONS, svd_average
from fedgrid.aggregation.lora_ranks import RankViews
from fedgrid.aggregation.mean import WeightedMean, weighted_mean, weighted_mean_of_rows
from fedgrid.aggregation.selection import Sampling, SelectionPolicy
from fedgrid.aggregation.updates import (
    add_update,
    aggregate_deltas,
    average_values,
    client_difference,
    client_value,
    is_optimizable,
    split_names,
)
from fedgrid.seeding import derive_seed
from fedgrid.types import ClientInfo, EvaluateIns, Failure, FitIns, FitRes, ModelState, Scalar

__all__ = [
    "WeightedMean",
    "FedAvg",
    "weighted_mean",
    "train_metrics",
    "check_strategy_tag",
    "AGGREGATION_SLICE",
]

#: Elements averaged at a time (a float64 accumulator of 8 MB).
AGGREGATION_SLICE = 1 << 20


class FedAvg(Strategy):
    """Broadcast the global model, clients train, average their models by examples.

    With an ``aggregator`` (a robust rule from ``fedgrid.aggregation.robust``), the server
    aggregates the clients' updates ``client - global`` of the real floating tensors with
    it and adds the result to the global model; every other tensor (integer buffers) takes
    the example-weighted mean of the clients' values. Without one, it averages the models
    themselves, exactly as McMahan et al.

    It takes results holding deltas (``accepts_deltas``; ``FitRes.delta``, a lossy uplink): an
    aggregator gets them as they are, and the plain mean averages them as differences and adds
    the mean to the global model (a value result among them has the model subtracted), slice
    by slice: no update is turned back into a model.

    Args:
        sampling: which clients a round asks and waits for, and what every task carries
            (default: every live client, no federated evaluation, seed 0).
        aggregator: the rule applied to the clients' updates; ``None`` averages models.
        lora_aggregation: how LoRA adapters merge (``fedgrid.aggregation.lora``): ``factors``
            and ``ffa`` average the state as it is; ``svd`` averages each pair's products and
            refactorizes them (no ``aggregator`` then).

    Raises:
        ValueError: an argument is out of range.
    """

    name: ClassVar[str] = "fedavg"
    accepts_deltas = True

    def __init__(
        self,
        *,
        sampling: Sampling | None = None,
        aggregator: Aggregator | None = None,
        lora_aggregation: str = "factors",
    ) -> None:
        if lora_aggregation not in LORA_AGGREGATIONS:
            raise ValueError(
                f"lora_aggregation must be one of {', '.join(LORA_AGGREGATIONS)}, got {lora_aggregation!r}"
            )
        if lora_aggregation == "svd" and aggregator is not None:
            raise ValueError("lora_aggregation svd averages the products itself: it takes no aggregator")
        self.sampling = sampling if sampling is not None else Sampling()
        self.aggregator = aggregator
        self.lora_aggregation = lora_aggregation
        self._state: ModelState | None = None

    @property
    def seed(self) -> int:
        """The seed of the run's draws (``sampling.seed``)."""
        return self.sampling.seed

    @property
    def selection(self) -> SelectionPolicy:
        """How many clients a round asks and waits for, and which (``sampling.policy``); set to change."""
        return self.sampling.policy

    @selection.setter
    def selection(self, policy: SelectionPolicy) -> None:
        self.sampling = replace(self.sampling, policy=policy)

    def initialize(self, *, initial_state: ModelState) -> None:
        self._state = OrderedDict((k, v.detach().clone()) for k, v in initial_state.items())

    @property
    def global_state(self) -> ModelState:
        if self._state is None:
            raise RuntimeError("strategy has no global model: call initialize() first")
        return self._state

    def clients_per_round(self, num_clients: int) -> int:
        """How many results a round with ``num_clients`` live clients waits for."""
        return self.sampling.clients_per_round(num_clients)

    def round_target(self, *, num_live: int, num_assigned: int) -> int:
        return min(num_assigned, self.clients_per_round(num_live))

    def check_preconditions(self, *, num_clients: int) -> None:
        if self.aggregator is not None:
            self.aggregator.check_preconditions(num_clients=self.clients_per_round(num_clients))

    def _begin_aggregation(self, server_round: int, part: int = 0) -> None:
        """Seeds the aggregator's random draws (Krum's buckets) for ``server_round`` and ``part``
        of the model (a block), from the run's seed: the same round always draws the same."""
        if self.aggregator is not None:
            self.aggregator.begin_round(seed=derive_seed("aggregate", self.seed, server_round, part))

    def _task_config(self, server_round: int) -> dict[str, Scalar]:
        """The scalars every task of ``server_round`` carries."""
        return self.sampling.task_config(server_round)

    def configure_round(
        self, *, server_round: int, clients: Sequence[ClientInfo]
    ) -> list[tuple[ClientInfo, FitIns]]:
        ins = FitIns(round=server_round, config=self._task_config(server_round))
        return [(client, ins) for client in self.sampling.fit_clients(clients, server_round)]

    def configure_evaluate(
        self, *, server_round: int, clients: Sequence[ClientInfo]
    ) -> list[tuple[ClientInfo, EvaluateIns]]:
        ins = EvaluateIns(round=server_round, config={"round": server_round, "seed": self.seed})
        return [(client, ins) for client in self.sampling.evaluate_clients(clients, server_round)]

    def _update_subset(self, *, names: Sequence[str], results: Sequence[FitRes]) -> ModelState:
        """The new values of the global tensors ``names`` from ``results`` (canonical order): with
        ``lora_aggregation`` ``svd``, its LoRA pairs by ``fedgrid.aggregation.lora.svd_average``,
        the rest (and every tensor otherwise) by ``_update_values``."""
        if self.lora_aggregation != "svd":
            return self._update_values(names=names, results=results)
        merged = svd_average(self.global_state, results, names, RankViews(self.global_state).at)
        rest = self._update_values(names=[n for n in names if n not in merged], results=results)
        return OrderedDict((n, merged[n] if n in merged else rest[n]) for n in names)

    def _update_values(self, *, names: Sequence[str], results: Sequence[FitRes]) -> ModelState:
        """The new values of the global tensors ``names`` from ``results`` (canonical order).

        Subclasses change how updates become new values (server optimizers); partial
        strategies (blocks, fragments) call it once per part of the model.

        Raises:
            AggregationPreconditionError: the aggregator cannot run on this many results.
        """
        state = self.global_state
        if self.aggregator is None:
            # Slice by slice of each tensor, each over every result: with spilled (memory-
            # mapped) results only that slice of one update is read at a time, and the
            # float64 accumulator is one slice, so aggregating costs about the new model.
            out: ModelState = OrderedDict()
            weights = [res.mean_weight for res in results]
            for name in names:
                target = state[name]
                given = [res.state.get(name) for res in results]
                values = not any(
                    res.delta for res in results
                )  # rows of deltas would need the model added back
                if values and all(g is not None and g.shape == target.shape for g in given):
                    # The batched simulation engine's results are rows of its stacks: one reduction per stack.
                    rows = weighted_mean_of_rows(given, weights)  # type: ignore[arg-type]
                    if rows is not None:
                        out[name] = rows.to(target.dtype)
                        continue
                del given
                # Results holding differences are averaged as differences and the mean added to
                # the model: each update changes form once (its client's), not back to a value.
                differences = not values and is_optimizable(target.dtype)
                take = client_difference if differences else client_value
                new_value = torch.empty_like(target)
                flat = new_value.view(-1)
                for start in range(0, max(target.numel(), 1), AGGREGATION_SLICE):
                    part_of = slice(start, start + AGGREGATION_SLICE)
                    agg = WeightedMean()
                    for res in results:
                        got = res.state.get(name)
                        if got is None or got.shape != target.shape:
                            who = res.client.name or res.client.client_id
                            raise ValueError(
                                f"result from client {who!r}: tensor '{name}' is missing or has the wrong shape"
                            )
                        part = take(state, res, name, part_of)
                        assert part is not None  # checked above: the result holds the tensor
                        agg.add({name: part}, res.mean_weight)
                        del got, part
                    piece = agg.result()[name]
                    if differences:
                        ref = target.reshape(-1)[part_of]
                        piece = (ref.to(piece.dtype) + piece).to(target.dtype)  # as ``add_update``
                    flat[start : start + piece.numel()] = piece
                out[name] = new_value
            return out
        floating, others = split_names(state, names)
        new = add_update(
            state,
            aggregate_deltas(global_state=state, results=results, names=floating, aggregator=self.aggregator),
        )
        new.update(average_values(results, others, aggregator=self.aggregator))
        return OrderedDict((n, new[n]) for n in names)

    def aggregate(
        self, *, server_round: int, results: Sequence[FitRes], failures: Sequence[Failure]
    ) -> dict[str, float]:
        if not results:
            return {}
        ordered = sorted(results, key=lambda r: r.client.sort_key)  # canonical order
        metrics = train_metrics(ordered)
        self._begin_aggregation(server_round)
        try:
            update = self._update_subset(names=list(self.global_state), results=ordered)
        except AggregationPreconditionError:
            return {**metrics, "aggregation_skipped": 1.0}
        self._state = OrderedDict((n, update.get(n, t)) for n, t in self.global_state.items())
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "strategy": self.name, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_strategy_tag(state, self.name)
        self.initialize(initial_state=state["global_state"])
        self.sampling = self.sampling.with_seed(int(state.get("seed", self.seed)))


def train_metrics(ordered: Sequence[FitRes]) -> dict[str, float]:
    """``train_loss``: the example-weighted mean of the ``loss`` the clients reported, if any."""
    train = weighted_metrics(
        [(r.num_examples, {"loss": r.metrics["loss"]}) for r in ordered if "loss" in r.metrics]
    )
    return {"train_loss": train["loss"]} if train else {}


def check_strategy_tag(state: Mapping[str, Any], name: str) -> None:
    """Refuses a checkpoint written by another strategy (a checkpoint without a tag is accepted).

    Raises:
        ValueError: ``state`` was written by a strategy other than ``name``.
    """
    tag = state.get("strategy")
    if tag is not None and tag != name:
        raise ValueError(f"checkpoint was written by strategy {tag!r}, cannot resume it as {name!r}")
