"""Fault injection for robust aggregation: Byzantine clients as a ``Client`` wrapper, and a
simulation runner that lets a test wrap some of its clients (a test utility, not product code)."""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta
from typing import Callable

import torch

from fedgrid.client.api import Client, EvaluateOutput, FitOutput
from fedgrid.config import Config
from fedgrid.seeding import derive_seed
from fedgrid.server.engine import RoundEngine
from fedgrid.server.influence import build_influence
from fedgrid.server.strategies import build_strategy
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.simulation.tasks import client_options, resolve
from fedgrid.types import FitIns, ModelState, RoundMetrics

ATTACKS = ("sign-flip", "gaussian")


class Byzantine(Client):
    """Trains honestly, then sends a poisoned model instead.

    ``sign-flip``: ``global - scale * (trained - global)``, the honest update reversed and
    scaled. ``gaussian``: ``global + scale * N(0, 1)`` per coordinate, seeded by round and name.
    Integer tensors are sent as trained.
    """

    def __init__(self, inner: Client, attack: str, scale: float) -> None:
        if attack not in ATTACKS:
            raise ValueError(f"unknown attack {attack!r}")
        self.inner, self.attack, self.scale = inner, attack, scale
        self.name, self.region = inner.name, inner.region

    @property
    def num_examples(self) -> int:
        return self.inner.num_examples

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        out = self.inner.fit(state, ins)
        noise = torch.Generator().manual_seed(derive_seed("attack", ins.round, self.name))
        poisoned: ModelState = OrderedDict()
        for name, trained in out.state.items():
            if not trained.is_floating_point():
                poisoned[name] = trained
            elif self.attack == "sign-flip":
                poisoned[name] = state[name] - self.scale * (trained - state[name])
            else:
                poisoned[name] = state[name] + self.scale * torch.randn(
                    trained.shape, generator=noise, dtype=trained.dtype
                )
        return FitOutput(poisoned, out.num_examples, out.metrics)

    def evaluate(self, state: ModelState, config) -> EvaluateOutput:  # type: ignore[no-untyped-def]
        return self.inner.evaluate(state, config)


def simulate(config: Config, *, wrap: Callable[[int, Client], Client] = lambda i, c: c) -> list[RoundMetrics]:
    """``run_simulation`` with client ``i`` replaced by ``wrap(i, client)``; returns the metrics."""
    strategy = build_strategy(config, num_clients=config.clients)
    resolved = resolve(dataset=config.dataset, seed=config.seed, data_dir=config.data_dir)
    strategy.initialize(initial_state=resolved.initial_state)
    clients = [
        wrap(i, resolved.client_factory(i, config.clients, config.seed, **client_options(config)))
        for i in range(config.clients)
    ]
    engine = RoundEngine(
        strategy=strategy,
        fleet=InProcessFleet(clients),
        rounds=config.rounds,
        min_clients=1,
        round_timeout=timedelta(seconds=60),
        join_timeout=timedelta(seconds=60),
        evaluate_fn=resolved.evaluate,
        influence=build_influence(config),
    )
    engine.run()
    return engine.history
