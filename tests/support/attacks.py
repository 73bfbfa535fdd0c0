"""Fault injection for robust aggregation: Byzantine clients as a ``Client`` wrapper, small
clients that lie about their weight or send far updates, and runners for one federation both
simulated (``InProcessFleet``) and deployed over in-process gRPC (a test utility, not product code)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch

from fedgrid.aggregation import build_strategy_from
from fedgrid.client import start_client
from fedgrid.client.api import Client, EvaluateOutput, FitOutput
from fedgrid.client.task_feed import ClientEvent
from fedgrid.config import Config
from fedgrid.events import Event, EventLog
from fedgrid.fleet.bounds import UpdateBounds
from fedgrid.seeding import derive_seed
from fedgrid.server.engine import RoundEngine
from fedgrid.server.influence import Influence, build_influence
from fedgrid.server.parts import RoundRules, RunIO, Schedule
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.server.strategies import build_strategy
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.simulation.tasks import client_options, resolve
from fedgrid.types import FitIns, ModelState, RoundMetrics

from harness import wait_until

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
        wrap(i, resolved.client_factory(i, config.clients, config.seed, client_options(config)))
        for i in range(config.clients)
    ]
    engine = RoundEngine(
        strategy=strategy,
        fleet=InProcessFleet(clients),
        schedule=Schedule(
            rounds=config.rounds,
            min_clients=1,
            round_timeout=timedelta(seconds=60),
            join_timeout=timedelta(seconds=60),
        ),
        rules=RoundRules(
            influence=build_influence(config),
        ),
        io=RunIO(
            evaluate_fn=resolved.evaluate,
        ),
    )
    engine.run()
    return engine.history


class Step(Client):
    """A small honest client: adds ``0.01 * k`` to every floating tensor and claims ``claim``
    examples; from round ``far_from`` on (0: never), its step is ``far`` instead."""

    def __init__(self, name: str, k: int, *, claim: int = 3, far: float = 0.0, far_from: int = 0) -> None:
        self.name, self.region, self.k, self.claim, self.far, self.far_from = (
            name,
            "",
            k,
            claim,
            far,
            far_from,
        )

    @property
    def num_examples(self) -> int:
        return self.claim

    def step(self, ins: FitIns) -> float:
        return self.far if self.far_from and ins.round >= self.far_from else 0.01 * self.k

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        by = self.step(ins)
        out = OrderedDict((n, v + by if v.is_floating_point() else v) for n, v in state.items())
        return FitOutput(out, num_examples=self.claim, metrics={"loss": float(self.k)})


class Poisoner(Step):
    """An admitted attacker claiming ``claim`` examples (at Join too). ``steer``: steps -0.1 (within
    the default distance bound of its honest peers' steps of 0.01 and 0.02) and sends 10**6 in
    integer tensors; ``constant``: uploads the model 0.123 everywhere; ``scale``: an honest step
    times 1000; ``huge``: the finite value 3e38 everywhere."""

    def __init__(self, name: str, attack: str, *, claim: int = 3) -> None:
        super().__init__(name, 5, claim=claim)
        if attack not in ("steer", "constant", "scale", "huge"):
            raise ValueError(f"unknown attack {attack!r}")
        self.attack = attack

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        value = {"steer": -0.1, "scale": 1000 * 0.01 * self.k}.get(self.attack)
        if value is not None:
            out = OrderedDict(
                (n, v + value if v.is_floating_point() else torch.full_like(v, 10**6))
                for n, v in state.items()
            )
        else:
            value = 0.123 if self.attack == "constant" else 3e38
            out = OrderedDict(
                (n, torch.full_like(v, value) if v.is_floating_point() else v) for n, v in state.items()
            )
        return FitOutput(out, num_examples=self.claim, metrics={"loss": 0.0})


def small_model() -> ModelState:
    g = torch.Generator().manual_seed(11)
    return OrderedDict(
        [
            ("w", torch.randn(4, 3, generator=g)),
            ("b", torch.randn(4, generator=g)),
            ("steps", torch.tensor(7)),
        ]
    )


@dataclass
class Federation:
    """What a run of ``run_federation`` left: its engine (history, final model), its events, and
    per client its run summary's rounds (or the error it stopped with) and its ``error`` events."""

    engine: RoundEngine
    events: list[Event]
    rounds: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, list[ClientEvent]] = field(default_factory=dict)

    def model(self) -> ModelState:
        return self.engine.strategy.global_state

    def seen(self, name: str) -> list[Event]:
        return [e for e in self.events if e.event == name]


def _engine(
    fleet, rounds: int, strategy: str, options: dict, events: EventLog, influence: Influence | None
) -> RoundEngine:
    built = build_strategy_from(strategy, seed=0, **options)
    built.initialize(initial_state=small_model())
    return RoundEngine(
        strategy=built,
        fleet=fleet,
        schedule=Schedule(
            rounds=rounds,
            min_clients=2,
            round_timeout=timedelta(seconds=60),
            join_timeout=timedelta(seconds=60),
            finish_timeout=timedelta(seconds=10),
        ),
        rules=RoundRules() if influence is None else RoundRules(influence=influence),  # None: the default
        io=RunIO(events=events),
    )


def run_federation(
    clients: Sequence[Client],
    *,
    rounds: int = 3,
    deployed: bool = True,
    strategy: str = "fedavg",
    options: dict | None = None,
    influence: Influence | None = None,
    bounds: UpdateBounds | None = None,
) -> Federation:
    """``rounds`` rounds of ``clients`` on ``small_model()``: over in-process gRPC (``deployed``:
    a ``Coordinator`` on port 0, each client in ``start_client``) or simulated (``InProcessFleet``)."""
    events, seen = EventLog(), []
    events.subscribe(seen.append)
    if not deployed:
        engine = _engine(
            InProcessFleet(list(clients), bounds=bounds), rounds, strategy, options or {}, events, influence
        )
        engine.run()
        return Federation(engine, seen)
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=30), events=events, bounds=bounds)
    server = Coordinator("127.0.0.1:0", fleet, max_workers=16).start()
    engine = _engine(fleet, rounds, strategy, options or {}, events, influence)
    run = Federation(engine, seen, errors={c.name: [] for c in clients})

    def on_event(name: str) -> Callable[[ClientEvent], None]:
        return lambda e: run.errors[name].append(e) if e.kind == "error" else None

    handles = [start_client(c, server.address, poll_wait_s=1.0, on_event=on_event(c.name)) for c in clients]
    try:
        wait_until(lambda: len(fleet.live_clients()) == len(clients), timeout=30, what="clients to join")
        runner = threading.Thread(target=engine.run, daemon=True)
        runner.start()
        runner.join(timeout=120)
        assert not runner.is_alive(), "the run did not finish"
        for c, h in zip(clients, handles):
            try:
                run.rounds[c.name] = h.join(timeout=30).rounds
            except Exception as exc:  # the client stopped with an error: the test says which
                run.rounds[c.name] = exc
    finally:
        for h in handles:
            h.stop()
        server.stop(grace=0.5)
        fleet.close()
    return run
