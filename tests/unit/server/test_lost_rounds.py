"""A round whose results are all lost fails (``round_failed``, with the reason) and runs again
under the same number with the same selection, never committed empty (issue 26, item 4)."""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta

import pytest
import torch

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.selection import Sampling
from fedgrid.errors import RoundLostError
from fedgrid.events import EventLog
from fedgrid.fleet.base import Fleet, RoundOutcome
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import RunIO, Schedule
from fedgrid.types import ClientInfo, Failure, FitRes

CLIENTS = [ClientInfo(client_id=f"c{i}", name=f"site-{i}", num_examples=i + 1) for i in range(3)]


class Flaky(Fleet):
    """Client i sends ``global + (i + 1) * round``; the attempts listed in ``lose`` (1-based, in
    the order fit phases are asked for) lose every result: the clients died or went silent."""

    def __init__(self, lose: set[int] = frozenset()) -> None:
        self.lose = lose
        self.fits: list[tuple[int, list[tuple[str, dict]]]] = []
        self.committed_rounds: list[int] = []

    def wait_for_clients(self, *, min_clients, timeout):
        return CLIENTS

    def fit_round(self, *, server_round, global_state, assignments, timeout, target=None):
        self.fits.append((server_round, [(info.client_id, dict(ins.config)) for info, ins in assignments]))
        if len(self.fits) in self.lose:
            return RoundOutcome(
                [], [Failure(info, "client went silent (no heartbeat)") for info, _ in assignments]
            )
        results = [
            FitRes(info, OrderedDict((k, v + (i + 1) * server_round) for k, v in global_state.items()), i + 1)
            for i, (info, _) in enumerate(assignments)
        ]
        return RoundOutcome(results, [])

    def evaluate_round(self, *, server_round, global_state, assignments, timeout):
        return RoundOutcome([], [])

    def message_round(self, *, server_round, phase, assignments, timeout):
        return RoundOutcome([], [])

    def committed(self, server_round):
        self.committed_rounds.append(server_round)


def _engine(fleet: Fleet, *, retries: int, rounds: int = 3) -> tuple[RoundEngine, list]:
    # Two of three clients a round, drawn from the seed and the round number.
    strategy = FedAvg(sampling=Sampling(fraction_fit=0.67, min_fit_clients=2, seed=5))
    strategy.initialize(initial_state=OrderedDict(w=torch.zeros(3), b=torch.ones(2)))
    events = EventLog()
    seen: list = []
    events.subscribe(seen.append)
    engine = RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=rounds,
            min_clients=1,
            round_timeout=timedelta(seconds=1),
            join_timeout=timedelta(seconds=1),
            round_retries=retries,
        ),
        io=RunIO(
            events=events,
        ),
    )
    return engine, seen


def test_a_lost_round_runs_again_under_its_number_and_ends_on_the_uninterrupted_model():
    clean, _ = _engine(Flaky(), retries=2)
    expected = clean.run()
    fleet = Flaky(lose={2, 3})  # round 2 is lost twice, then its clients are back
    engine, events = _engine(fleet, retries=2)
    final = engine.run()
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name
    assert [r for r, _ in fleet.fits] == [1, 2, 2, 2, 3]
    assert fleet.fits[1][1] == fleet.fits[2][1] == fleet.fits[3][1]  # the same selection and seed
    assert [m.round for m in engine.history] == [1, 2, 3]
    assert [m.clients_ok for m in engine.history] == [2, 2, 2]
    assert engine.history[1].extra["round_retries"] == 2.0 and "round_retries" not in engine.history[2].extra
    failed = [e for e in events if e.event == "round_failed"]
    assert [(e["round"], e["attempt"], e["retry"]) for e in failed] == [(2, 1, True), (2, 2, True)]
    assert "round 2: all 2 results lost" in failed[0]["reason"]
    assert "client went silent (no heartbeat)" in failed[0]["reason"]
    assert [e["round"] for e in events if e.event == "round_committed"] == [1, 2, 3]
    assert engine.lost_rounds.lost == 2


def test_a_round_lost_more_often_than_retried_stops_the_run_with_its_state_committed():
    fleet = Flaky(lose={2, 3, 4})
    engine, events = _engine(fleet, retries=2)
    with pytest.raises(
        RoundLostError, match=r"round 2: all 2 results lost .*lost 3 times in a row: stopping"
    ):
        engine.run()
    assert [m.round for m in engine.history] == [1]
    after_round_1 = OrderedDict(w=torch.zeros(3), b=torch.ones(2))
    clean, _ = _engine(Flaky(), retries=0, rounds=1)
    after_round_1 = clean.run()
    for name, tensor in after_round_1.items():  # nothing of the lost attempts was applied
        assert torch.equal(engine.strategy.global_state[name], tensor), name
    assert [e["retry"] for e in events if e.event == "round_failed"] == [True, True, False]


def test_without_retries_a_lost_round_is_committed_as_before():
    fleet = Flaky(lose={2})
    engine, events = _engine(fleet, retries=0)
    engine.run()
    assert [(m.round, m.clients_ok, m.clients_failed) for m in engine.history] == [
        (1, 2, 0),
        (2, 0, 2),
        (3, 2, 0),
    ]
    assert not [e for e in events if e.event == "round_failed"]
