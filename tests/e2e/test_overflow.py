"""Two admitted clients upload the finite value 3e38 everywhere in some rounds, over real gRPC:
each passes every per-update check, but the aggregate is not finite (FedAdam's second moment
of a 3e38 pseudo-gradient overflows). Those rounds fail: the previous model and optimizer
state stay, nothing is checkpointed for them, ``round_failed`` is emitted, the honest clients
carry on, and the final model equals, bit for bit, that of a run in which the failed rounds
were never run (the same clients, honest in every round, run rounds 1, 3 and 5 only).
With ``max_update_norm`` on, the same uploads are refused at once and their rounds commit; the
attackers stay (a refusal is the round's failure, not the client's end). The default distance
bound (``max_update_ratio``) and the median update's spread check (``max_deviation_ratio``)
would refuse them too: they are off here, where the subject is the engine's last line of
defence, a non-finite aggregate.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import timedelta

import torch

from fedgrid.aggregation import build_strategy_from
from fedgrid.client import Client, FitOutput, start_client
from fedgrid.events import EventLog
from fedgrid.fleet.bounds import UpdateBounds
from fedgrid.server.engine import ROUND_FAILED, RoundEngine
from fedgrid.server.influence import Influence
from fedgrid.server.parts import RoundRules, RunIO, Schedule
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.server.state import StateStore
from fedgrid.simulation.fleet import InProcessFleet

from harness import wait_until

ROUNDS, POISONED = 5, (2, 4)


class Shift(Client):
    """Adds ``0.01 * k`` to every floating tensor; integer tensors unchanged."""

    def __init__(self, name: str, k: int, poisoned: tuple[int, ...] = ()) -> None:
        self.name, self.k, self.poisoned = name, k, poisoned

    @property
    def num_examples(self) -> int:
        return 3

    def fit(self, state, ins):
        def out(v):
            if not v.is_floating_point():
                return v
            return torch.full_like(v, 3e38) if ins.round in self.poisoned else v + 0.01 * self.k

        return FitOutput(
            OrderedDict((n, out(v)) for n, v in state.items()),
            num_examples=3,
            metrics={"loss": float(self.k)},
        )


def _clients(poisoned: tuple[int, ...]) -> list[Client]:
    return [
        Shift("honest-1", 1),
        Shift("honest-2", 2),
        Shift("attacker-1", 3, poisoned),
        Shift("attacker-2", 4, poisoned),
    ]


def _initial():
    g = torch.Generator().manual_seed(5)
    return OrderedDict(
        [
            ("w", torch.randn(4, 3, generator=g)),
            ("b", torch.randn(4, generator=g)),
            ("steps", torch.tensor(7)),
        ]
    )


def _engine(fleet, strategy, *, min_clients: int = 4, **io) -> RoundEngine:
    return RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=ROUNDS,
            min_clients=min_clients,
            round_timeout=timedelta(seconds=60),
            join_timeout=timedelta(seconds=60),
            finish_timeout=timedelta(seconds=10),
        ),
        rules=RoundRules(
            influence=Influence(max_update_ratio=0, min_update_cosine=-1, max_deviation_ratio=0)
        ),
        io=RunIO(**io),
    )


def _deploy(tmp_path, bounds: UpdateBounds | None = None, *, min_clients: int = 4):
    events, seen = EventLog(), []
    events.subscribe(seen.append)
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=30), events=events, bounds=bounds)
    server = Coordinator("127.0.0.1:0", fleet, max_workers=16).start()
    strategy = build_strategy_from("fedadam", seed=0)
    strategy.initialize(initial_state=_initial())
    store = StateStore(tmp_path / "state", keep=5)
    engine = _engine(fleet, strategy, min_clients=min_clients, store=store, events=events)
    handles = [start_client(c, server.address, poll_wait_s=1.0) for c in _clients(POISONED)]
    try:
        wait_until(lambda: len(fleet.live_clients()) == 4, timeout=30, what="clients to join")
        runner = threading.Thread(target=engine.run, daemon=True)
        runner.start()
        runner.join(timeout=120)
        assert not runner.is_alive()
        summaries = [_outcome(h) for h in handles]
    finally:
        for h in handles:
            h.stop()
        server.stop(grace=0.5)
        fleet.close()
    return engine, store, seen, summaries


def _outcome(handle):
    """A client's run summary, or the error it stopped with."""
    try:
        return handle.join(timeout=30)
    except Exception as exc:
        return exc


def _reference(rounds) -> RoundEngine:
    """The same clients, honest in every round, running ``rounds`` only, in process."""
    strategy = build_strategy_from("fedadam", seed=0)
    strategy.initialize(initial_state=_initial())
    engine = _engine(InProcessFleet(_clients(())), strategy)
    for r in rounds:
        engine.commit(engine.run_round(r))
    return engine


def _assert_same_state(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _assert_same_state(a[key], b[key], f"{where}.{key}")
    else:
        assert a == b, where


def test_rounds_with_an_overflowing_aggregate_fail_and_the_run_goes_on(tmp_path):
    engine, store, seen, summaries = _deploy(tmp_path)
    failed = [m.round for m in engine.history if m.extra.get(ROUND_FAILED)]
    assert failed == list(POISONED)
    assert [m.round for m in engine.history] == [1, 2, 3, 4, 5]
    assert all(
        m.clients_ok == 4 and m.clients_failed == 0 for m in engine.history
    )  # every update passed its checks
    assert [e["round"] for e in seen if e.event == "round_failed"] == list(POISONED)
    assert [e["round"] for e in seen if e.event == "checkpoint_written"] == [1, 3, 5]
    assert [e["round"] for e in seen if e.event == "round_committed"] == [1, 3, 5]
    assert [r for r, _ in store.checkpoints()] == [5, 3, 1]
    assert all(s.rounds == ROUNDS for s in summaries)  # the honest clients trained every round

    reference = _reference([1, 3, 5])
    for name, tensor in reference.strategy.global_state.items():
        assert torch.equal(engine.strategy.global_state[name], tensor), name
    _assert_same_state(
        engine.strategy.state_dict(), reference.strategy.state_dict()
    )  # moments and step count too
    latest = store.load_latest()  # a restart resumes the same finite state
    assert latest.round == 5
    for name, tensor in reference.strategy.global_state.items():
        assert torch.equal(latest.strategy["global_state"][name], tensor), name


def test_with_a_norm_bound_the_overflowing_uploads_are_refused(tmp_path):
    # A refused upload is that round's failure: the attackers go on, honest in rounds 3 and 5.
    engine, _, seen, summaries = _deploy(tmp_path, UpdateBounds(max_update_norm=1.0), min_clients=2)
    assert [m.round for m in engine.history if m.extra.get(ROUND_FAILED)] == []
    assert [(m.clients_ok, m.clients_failed) for m in engine.history] == [
        (4, 0),
        (2, 2),
        (4, 0),
        (2, 2),
        (4, 0),
    ]
    assert [s.rounds for s in summaries] == [ROUNDS, ROUNDS, 3, 3]  # the rounds whose update landed
    failures = [e for e in seen if e.event == "round_closed" and e["failures"]]
    assert [e["round"] for e in failures] == list(POISONED)
    assert [e["round"] for e in seen if e.event == "round_committed"] == [1, 2, 3, 4, 5]
    assert all(
        torch.isfinite(t).all() for t in engine.strategy.global_state.values() if t.is_floating_point()
    )
