"""DiLoCo (Douillard et al. 2023) and streaming DiLoCo (Douillard et al. 2025), server side.

DiLoCo: each worker runs ``inner_steps`` (H) steps of its own inner optimizer (AdamW, its
state kept across rounds on the worker) from the global model and sends back its model;
the server applies Nesterov SGD (outer lr 0.7, momentum 0.9) to the averaged
pseudo-gradient ``global - mean(workers)``. That is ``FedOpt`` with a Nesterov outer
optimizer; the task config tells workers ``inner_steps``.

Streaming DiLoCo: the model is split into F fragments (contiguous groups of modules,
balanced by size; ``blocks.default_blocks``). Round ``r`` syncs fragment ``r % F`` only:
workers upload just that fragment (``FitIns.expected``), the server applies the outer
step to it (each fragment has its own outer momentum) and leaves the other fragments as
they were. So only 1/F of the model crosses the uplink per round.

Worker side of streaming DiLoCo (what the task config asks): keep a local replica across
rounds; at round ``r`` overwrite only fragment ``merge_fragment`` (= ``(r - 1) % F``, the one
the server updated last round) with the downloaded global values, keep training the
rest locally, and upload fragment ``fragment`` (= ``r % F``) after the inner steps. A worker without a
replica (first round, new worker) takes the whole global model. The paper's overlap of
communication with computation and its mixing factor alpha (here 0) are not modelled.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, Sequence

from fedgrid.aggregation.base import AggregationPreconditionError, Aggregator
from fedgrid.aggregation.blocks import Block, default_blocks
from fedgrid.aggregation.fedavg import train_metrics
from fedgrid.aggregation.fedopt import FedOpt
from fedgrid.aggregation.server_opt import ServerSGD
from fedgrid.errors import ConfigError
from fedgrid.types import ClientInfo, FitIns, FitRes, Failure, ModelState, Scalar, TensorSpec

__all__ = ["DiLoCo", "StreamingDiLoCo"]


class DiLoCo(FedOpt):
    """DiLoCo's server: Nesterov outer SGD on the averaged pseudo-gradient.

    Task config sent to workers: ``algorithm = "diloco"``, ``inner_steps``.

    Args:
        outer_lr: outer learning rate.
        outer_momentum: outer Nesterov momentum.
        inner_steps: H, the inner optimizer steps each worker runs per round.
        aggregator: the rule applied to the workers' updates (default: weighted mean).
        fraction_fit, min_fit_clients, fraction_evaluate, seed, fit_config: as ``FedAvg``.

    Raises:
        ValueError: an argument is out of range.
    """

    name = "diloco"

    def __init__(
        self,
        *,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        inner_steps: int = 500,
        aggregator: Aggregator | None = None,
        fraction_fit: float = 1.0,
        min_fit_clients: int = 1,
        fraction_evaluate: float = 0.0,
        seed: int = 0,
        fit_config: Mapping[str, Scalar] | None = None,
    ) -> None:
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be at least 1, got {inner_steps}")
        super().__init__(
            server_optimizer=ServerSGD(lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0),
            aggregator=aggregator,
            fraction_fit=fraction_fit,
            min_fit_clients=min_fit_clients,
            fraction_evaluate=fraction_evaluate,
            seed=seed,
            fit_config=fit_config,
        )
        self.inner_steps = inner_steps

    def _task_config(self, server_round: int) -> dict[str, Scalar]:
        return {**super()._task_config(server_round), "algorithm": self.name, "inner_steps": self.inner_steps}


class StreamingDiLoCo(DiLoCo):
    """Streaming DiLoCo's server: one fragment of the model synced per round, in rotation.

    Task config sent to workers: ``algorithm = "streaming-diloco"``, ``inner_steps``,
    ``fragment`` (the fragment to upload), ``merge_fragment`` (the fragment to take from
    the download), ``num_fragments``, ``fragment_prefixes`` and ``merge_fragment_prefixes``
    (comma-joined name prefixes of those two fragments; see ``blocks.matches_prefix``).

    Args:
        num_fragments: F, the number of fragments.
        outer_lr, outer_momentum, inner_steps, aggregator, fraction_fit, min_fit_clients,
            fraction_evaluate, seed, fit_config: as ``DiLoCo``.

    Raises:
        ValueError: an argument is out of range.
        ConfigError: (at ``initialize``; key ``num_fragments``) the model has fewer tensors
            than fragments.
    """

    name = "streaming-diloco"

    def __init__(
        self,
        *,
        num_fragments: int = 2,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        inner_steps: int = 500,
        aggregator: Aggregator | None = None,
        fraction_fit: float = 1.0,
        min_fit_clients: int = 1,
        fraction_evaluate: float = 0.0,
        seed: int = 0,
        fit_config: Mapping[str, Scalar] | None = None,
    ) -> None:
        if num_fragments < 1:
            raise ValueError(f"num_fragments must be at least 1, got {num_fragments}")
        super().__init__(
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            inner_steps=inner_steps,
            aggregator=aggregator,
            fraction_fit=fraction_fit,
            min_fit_clients=min_fit_clients,
            fraction_evaluate=fraction_evaluate,
            seed=seed,
            fit_config=fit_config,
        )
        self.num_fragments = num_fragments
        self._fragments: list[Block] = []

    def initialize(self, *, initial_state: ModelState) -> None:
        try:
            self._fragments = default_blocks(TensorSpec.of(initial_state), self.num_fragments)
        except ValueError as exc:  # the model is known only now: still a configuration error
            raise ConfigError("num_fragments", str(exc)) from None
        super().initialize(initial_state=initial_state)

    @property
    def fragments(self) -> list[Block]:
        """The fragments, in model order (set by ``initialize``)."""
        if not self._fragments:
            raise RuntimeError("strategy has no global model: call initialize() first")
        return self._fragments

    def fragment_of_round(self, server_round: int) -> Block:
        """The fragment synced in ``server_round``: number ``server_round % F``."""
        return self.fragments[server_round % self.num_fragments]

    def configure_round(self, *, server_round: int, clients: Sequence[ClientInfo]) -> list[tuple[ClientInfo, FitIns]]:
        fragment = self.fragment_of_round(server_round)
        config = {
            **self._task_config(server_round),
            "fragment": fragment.index,
            "merge_fragment": (server_round - 1) % self.num_fragments,
            "num_fragments": self.num_fragments,
            "fragment_prefixes": ",".join(fragment.prefixes),
            "merge_fragment_prefixes": ",".join(self.fragments[(server_round - 1) % self.num_fragments].prefixes),
        }
        specs = TensorSpec.of(self.global_state)
        ins = FitIns(round=server_round, config=config, expected=OrderedDict((n, specs[n]) for n in fragment.names))
        return [(client, ins) for client in self._select_fit(clients, server_round)]

    def aggregate(self, *, server_round: int, results: Sequence[FitRes], failures: Sequence[Failure]) -> dict[str, float]:
        if not results:
            return {}
        ordered = sorted(results, key=lambda r: r.client.sort_key)
        metrics = {**train_metrics(ordered), "fragment": float(self.fragment_of_round(server_round).index)}
        names = self.fragment_of_round(server_round).names
        try:
            update = self._update_subset(names=names, results=ordered)
        except AggregationPreconditionError:
            return {**metrics, "aggregation_skipped": 1.0}
        self._state = OrderedDict((n, update.get(n, t)) for n, t in self.global_state.items())
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "num_fragments": self.num_fragments}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state.get("num_fragments", self.num_fragments)) != self.num_fragments:
            raise ValueError(f"checkpoint has {state['num_fragments']} fragments, this strategy {self.num_fragments}")
        super().load_state_dict(state)
