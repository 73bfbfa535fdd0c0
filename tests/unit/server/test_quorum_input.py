"""Bad input to semi-asynchronous rounds is named and changes nothing: the config keys, and a
quorum larger than the first round's selection (refused before the round opens)."""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta

import pytest
import torch

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.selection import Sampling
from fedgrid.config import load_config
from fedgrid.errors import ConfigError
from fedgrid.fleet.base import Fleet, Quorum, RoundOutcome, quorum_of
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import RoundRules, Schedule
from fedgrid.types import ClientInfo

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    "overrides, key, problem",
    [
        ({"min_quorum": -1}, "min_quorum", "must be at least 0, got -1"),
        ({"min_quorum": 2, "grace_s": -0.5}, "grace_s", "must be a finite number at least 0, got -0.5"),
        ({"min_quorum": 2, "max_staleness": -1}, "max_staleness", "must be at least 0, got -1"),
        ({"staleness_exponent": -1.0}, "staleness_exponent", "must be a finite number at least 0, got -1.0"),
        (
            {"min_quorum": 5, "clients_per_round": 3},
            "min_quorum",
            "a quorum of 5 is larger than the round's selection of 3 clients (clients_per_round)",
        ),
        ({"min_quorum": 2, "over_selection": 0.5}, "min_quorum", "does not go with over_selection"),
        ({"min_quorum": 2, "strategy": "streaming-diloco"}, "min_quorum", "cannot merge a late result"),
    ],
)
def test_bad_quorum_keys_are_named(overrides, key, problem):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert info.value.key == key and problem in str(info.value)


def test_quorum_from_config():
    assert quorum_of(load_config(overrides={})) is None  # 0: off, today's rounds
    config = load_config(
        overrides={"min_quorum": 2, "grace_s": 1.5, "max_staleness": 3, "staleness_exponent": 1.0}
    )
    assert quorum_of(config) == Quorum(min_quorum=2, grace_s=1.5, max_staleness=3, staleness_exponent=1.0)


class Three(Fleet):
    """Three live clients; records whether a fit round was opened."""

    def __init__(self):
        self.opened = 0

    def wait_for_clients(self, *, min_clients, timeout):
        return [ClientInfo(client_id=f"c{i}", name=f"n{i}") for i in range(3)]

    def fit_round(self, *, server_round, global_state, assignments, timeout, target=None, quorum=None):
        self.opened += 1
        return RoundOutcome([], [])

    def evaluate_round(self, *, server_round, global_state, assignments, timeout):
        return RoundOutcome([], [])


def test_quorum_larger_than_the_selection_is_refused_before_the_round_opens():
    fleet = Three()
    strategy = FedAvg(sampling=Sampling(fraction_fit=0.5, min_fit_clients=2))  # selects 2 of 3
    strategy.initialize(initial_state=OrderedDict(w=torch.zeros(2)))
    engine = RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=1,
            min_clients=1,
            round_timeout=timedelta(seconds=1),
            join_timeout=timedelta(seconds=1),
        ),
        rules=RoundRules(
            quorum=Quorum(min_quorum=3),
        ),
    )
    with pytest.raises(ConfigError) as info:
        engine.run()
    assert info.value.key == "min_quorum"
    assert "a quorum of 3 is larger than round 1's selection of 2 clients" in str(info.value)
    assert "fraction_fit / min_fit_clients" in str(info.value)
    assert fleet.opened == 0 and torch.equal(strategy.global_state["w"], torch.zeros(2))


def test_quorum_checks_its_own_values():
    with pytest.raises(ValueError, match="min_quorum must be at least 1, got 0"):
        Quorum(min_quorum=0)
    with pytest.raises(ValueError, match="must be at least 0"):
        Quorum(min_quorum=1, grace_s=-1.0)
    assert Quorum(min_quorum=1, max_staleness=4).refusal(task_round=3, merge_round=8) == (
        "result of round 3 is 5 rounds stale; max_staleness is 4"
    )
    assert Quorum(min_quorum=1, max_staleness=4).refusal(task_round=3, merge_round=7) is None


def test_a_region_refuses_a_quorum_of_its_own():
    """A region is one learner upstream; its regional rounds wait for its clients."""
    from fedgrid.region.region import run_region

    config = load_config(overrides={"min_quorum": 1, "upstream": "127.0.0.1:1", "name": "eu"})
    with pytest.raises(ConfigError) as info:
        run_region(config)
    assert info.value.key == "min_quorum" and "set min_quorum on the global coordinator" in str(info.value)


@pytest.mark.parametrize(
    "overrides, key, problem",
    [
        ({"min_quorum": 1}, "min_quorum", "only as the replay of a deployment's record"),
        ({"replay": "events.jsonl"}, "replay", "needs the deployment's min_quorum"),
        ({"min_quorum": 1, "replay": "nowhere/events.jsonl"}, "replay", "cannot read 'nowhere/events.jsonl'"),
    ],
)
def test_simulation_runs_quorum_rounds_only_as_a_replay(overrides, key, problem):
    from fedgrid.simulation.run import run_simulation

    with pytest.raises(ConfigError) as info:
        run_simulation(
            load_config(overrides={"rounds": 1, "clients": 2, "engine": "sequential", **overrides})
        )
    assert info.value.key == key and problem in str(info.value)


def test_coordinator_refuses_a_quorum_above_min_clients_before_creating_anything(tmp_path):
    from fedgrid.server.wiring import wire

    out = tmp_path / "run"
    config = load_config(overrides={"min_quorum": 3, "min_clients": 2, "out": str(out)})
    with pytest.raises(ConfigError) as info:
        wire(config, 1, OrderedDict(w=torch.zeros(2)), None, None)
    assert info.value.key == "min_quorum"
    assert "a quorum of 3 is larger than min_clients=2" in str(info.value)
    assert not out.exists()
