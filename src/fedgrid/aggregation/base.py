"""Extension points of the round engine: ``Strategy`` (what a round asks, how results become
the next global state) and ``Aggregator`` (the streaming arithmetic).

Both are pure: they take tensors and dataclasses and return tensors and dataclasses. The
engine around them does the I/O, so one strategy runs unchanged in simulation and over gRPC.
"""

from __future__ import annotations

import contextvars
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import torch

from fedgrid.errors import FedgridError, InvalidUpdateError
from fedgrid.types import (
    EVALUATE,
    FIT,
    ClientInfo,
    EvaluateIns,
    EvaluateRes,
    Failure,
    FitIns,
    FitRes,
    MessageIns,
    MessageRes,
    ModelState,
    UpdateRole,
)

__all__ = ["Aggregator", "AggregationPreconditionError", "Strategy", "held", "weighted_metrics"]

#: Set while ``Strategy.state_view`` runs: ``held`` hands out the strategy's own tensors.
_VIEWING: contextvars.ContextVar[bool] = contextvars.ContextVar("fedgrid_state_view", default=False)


def held(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as a ``state_dict`` holds it: a copy, or, inside ``Strategy.state_view``, the
    tensor itself. A ``state_dict`` that takes its tensors through ``held`` gives the round
    engine its state without a copy of the model (issue 40: the coordinator at 3.5x)."""
    return tensor if _VIEWING.get() else tensor.clone()


class AggregationPreconditionError(FedgridError, ValueError):
    """An aggregator cannot run on the updates it was given (e.g. Krum with n <= 2f + 2).

    Raised by ``Aggregator.result`` when a round delivered fewer updates than the rule
    needs; strategies catch it and leave the global model (or the block) unchanged rather
    than fall back to an aggregate without the promised robustness.
    """


def weighted_metrics(reports: Sequence[tuple[int, Mapping[str, float]]]) -> dict[str, float]:
    """Per metric, the mean over the reports that have it, weighted by their example counts."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for num_examples, metrics in reports:
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value) * num_examples
            weights[key] = weights.get(key, 0.0) + num_examples
    return {key: sums[key] / weights[key] for key in sums if weights[key] > 0}


class Aggregator(ABC):
    """Streaming weighted aggregation: ``add`` each update, then ``result``.

    Memory stays O(model size) however many updates are added.
    """

    @abstractmethod
    def add(self, update: Mapping[str, torch.Tensor], weight: float) -> None:
        """Folds one update in. ``weight`` must be positive and finite."""

    @abstractmethod
    def result(self) -> ModelState:
        """Returns the aggregate.

        Raises:
            ValueError: nothing was added.
        """

    def reset(self) -> None:
        """Forgets everything added so far."""

    def begin_round(self, *, seed: int) -> None:
        """Receives the seed of the round about to be aggregated, for a rule that draws at
        random (Krum's buckets); strategies derive it from the run's seed and the round, so a
        replayed round gives the same bits. Default: ignored (the rule is deterministic)."""

    def check_preconditions(self, *, num_clients: int) -> None:
        """Checks, when a run is configured, that this rule can run on ``num_clients`` updates.

        Default: any positive number of updates will do.

        Raises:
            ConfigError: (key ``aggregator``) the rule cannot run on that many updates.
        """


class Strategy(ABC):
    """Decides what each round asks of whom, and how results become the next global state.

    Attributes:
        accepts_deltas: ``aggregate`` takes results whose ``FitRes.delta`` is set (their
            floating tensors are differences from ``downlink_state``). Otherwise the round
            engine hands it models (``aggregation.updates.as_model``). Default ``False``.
        update_role: what it makes of the clients' updates (``fedgrid.types.UpdateRole``):
            the form and defaults an uplink codec takes under it. Default: model averaging.
    """

    accepts_deltas: bool = False
    update_role: UpdateRole = UpdateRole.MODEL_AVERAGE

    @abstractmethod
    def initialize(self, *, initial_state: ModelState) -> None:
        """Receives the initial global model."""

    @property
    @abstractmethod
    def global_state(self) -> ModelState:
        """The current global model."""

    @abstractmethod
    def configure_round(
        self, *, server_round: int, clients: Sequence[ClientInfo]
    ) -> list[tuple[ClientInfo, FitIns]]:
        """Chooses the clients of ``server_round`` among the live ``clients`` and their tasks."""

    @abstractmethod
    def aggregate(
        self, *, server_round: int, results: Sequence[FitRes], failures: Sequence[Failure]
    ) -> dict[str, float]:
        """Folds the round's results into the global model; returns round metrics.

        Failures are data: the strategy decides what a failed client means for the round.
        """

    def downlink_state(self, *, server_round: int) -> ModelState:
        """The tensors the fleet sends every client of ``server_round``'s fit tasks.

        Default: the global model. A strategy whose clients need more (SCAFFOLD's server
        control variate) adds tensors here under names that cannot clash with the model's.
        A strategy whose clients need less (streaming DiLoCo: only the fragments synced since
        a client's last round) names, per client, the tensors of this state it downloads in
        ``FitIns.download``; the fleet sends only those on a lossless downlink.
        Evaluation tasks always get ``global_state`` alone.
        """
        return self.global_state

    def check_preconditions(self, *, num_clients: int) -> None:
        """Checks, when a run is configured, that the strategy can run with ``num_clients`` clients.

        Default: no requirement.

        Raises:
            ConfigError: the strategy or its aggregator cannot run on that many clients.
        """

    def round_target(self, *, num_live: int, num_assigned: int) -> int:
        """Results after which a round closes (fewer than assigned when over-selecting)."""
        return num_assigned

    def phases(self, *, server_round: int) -> Sequence[str]:
        """The phases of ``server_round``, in order: ``fit`` (``configure_round`` ->
        ``aggregate``), ``evaluate`` (``configure_evaluate`` -> ``aggregate_evaluate``), and
        any other name is a message phase (``configure_messages`` -> ``receive_messages``),
        in which each chosen client sends small messages that the coordinator relays to
        their recipients. Secure aggregation is advertise keys, share keys, a masked fit,
        unmask. Default: ``("fit", "evaluate")``."""
        return (FIT, EVALUATE)

    def configure_messages(
        self, *, server_round: int, phase: str, clients: Sequence[ClientInfo]
    ) -> list[tuple[ClientInfo, MessageIns]]:
        """Chooses the clients of message phase ``phase`` and their tasks (``MessageIns.peers``
        names who may be addressed). ``clients`` are the round's live clients.

        Raises:
            NotImplementedError: the default; a strategy declaring message phases implements it.
        """
        raise NotImplementedError(
            f"{type(self).__name__} declares message phase {phase!r} but does not implement configure_messages()"
        )

    def receive_messages(
        self, *, server_round: int, phase: str, results: Sequence[MessageRes], failures: Sequence[Failure]
    ) -> dict[str, float]:
        """Receives what the clients of message phase ``phase`` sent (all of it: to peers,
        to everyone and to the server), once the phase closed; returns round metrics. A
        client that sent nothing by the deadline, reported a failure or left is a failure.
        Default: keeps nothing."""
        return {}

    def configure_evaluate(
        self, *, server_round: int, clients: Sequence[ClientInfo]
    ) -> list[tuple[ClientInfo, EvaluateIns]]:
        """Chooses clients to evaluate the new global model on their data. Default: none."""
        return []

    def aggregate_evaluate(
        self, *, server_round: int, results: Sequence[EvaluateRes], failures: Sequence[Failure]
    ) -> dict[str, float]:
        """Example-weighted mean of each metric the clients reported (keys as reported)."""
        return weighted_metrics(
            [(r.num_examples, r.metrics) for r in sorted(results, key=lambda r: r.client.sort_key)]
        )

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (global model included): copies, safe to keep
        while the strategy goes on. Tensors taken through ``held`` are copied here and not in
        ``state_view``."""
        return {"global_state": OrderedDict((k, held(v)) for k, v in self.global_state.items())}

    def state_view(self) -> dict[str, Any]:
        """``state_dict`` without the copies its tensors took through ``held``: the strategy's
        own tensors, valid until it changes again. The round engine writes it out at once (its
        rollback point, the checkpoint) and checks it for NaN, so the coordinator holds no
        second model. A ``state_dict`` that copies by other means still copies here."""
        token = _VIEWING.set(True)
        try:
            return self.state_dict()
        finally:
            _VIEWING.reset(token)

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what ``state_dict`` returned."""

    def receive_global(self, *, state: ModelState) -> None:
        """Adopts a global model that comes from outside the rounds (a regional coordinator
        receiving the global coordinator's model), between rounds.

        Default: after checking that ``state`` has the current model's tensors (names,
        shapes, dtypes), starts again from it with ``initialize``, so per-run state tied to
        the old model (server-optimizer moments, control variates) starts afresh. A
        strategy whose state should survive such a jump overrides this.

        Raises:
            InvalidUpdateError: a tensor missing, extra, or of another shape or dtype
                (the strategy is unchanged).
        """
        current = self.global_state
        if list(state) != list(current):
            missing, extra = sorted(set(current) - set(state)), sorted(set(state) - set(current))
            raise InvalidUpdateError(
                f"received model: tensors differ (missing {missing}, unexpected {extra})"
                if missing or extra
                else "received model: tensors in another order"
            )
        for name, tensor in state.items():
            if tensor.shape != current[name].shape or tensor.dtype != current[name].dtype:
                raise InvalidUpdateError(
                    f"received model: tensor '{name}' is {tensor.dtype}{tuple(tensor.shape)}, "
                    f"expected {current[name].dtype}{tuple(current[name].shape)}"
                )
            if tensor.dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
                raise InvalidUpdateError(f"received model: tensor '{name}' is not finite")
        self.initialize(initial_state=state)
