"""The bounds on a client's weight and update norm, the non-finite round, and what the
in-process fleet refuses: the same rules as the coordinator's."""

from __future__ import annotations

import math
from collections import OrderedDict
from datetime import timedelta

import pytest
import torch

from fedgrid.aggregation import build_strategy_from
from fedgrid.client import Client, FitOutput
from fedgrid.errors import InvalidUpdateError
from fedgrid.fleet.bounds import UpdateBounds
from fedgrid.server.engine import ROUND_FAILED, RoundEngine, first_non_finite
from fedgrid.server.parts import RunIO, Schedule
from fedgrid.server.state import StateStore
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.textsafe import check_label, escape

BASE = OrderedDict(w=torch.zeros(2, 3), b=torch.zeros(4, dtype=torch.float64), steps=torch.tensor(7))


def test_claims_are_bounded_by_the_join_report_and_the_maximum():
    bounds = UpdateBounds(max_num_examples=100)
    bounds.check_claim(10, joined=10)
    with pytest.raises(InvalidUpdateError, match="the update claims 11, the client reported 10 at join"):
        bounds.check_claim(11, joined=10)
    with pytest.raises(InvalidUpdateError, match="101 claimed, over the maximum of 100"):
        bounds.check_claim(101, joined=1000)
    bounds.check_claim(50, joined=10, evaluate=True)  # a test set may be larger than the training set
    with pytest.raises(InvalidUpdateError, match="101 reported at join, must be in 0..100"):
        bounds.check_join(101)
    with pytest.raises(ValueError, match="max_update_norm"):
        UpdateBounds(max_update_norm=math.inf)


def test_norm_is_float64_over_floating_tensors_and_refuses_early():
    bounds = UpdateBounds(max_update_norm=5.0)
    assert bounds.norm(BASE) is not None and UpdateBounds().norm(BASE) is None
    meter = bounds.norm(BASE)
    meter.add("w", torch.full((2, 3), 1.0))  # sqrt(6)
    meter.add("steps", torch.tensor(10**6))  # integer tensors are not directions
    assert meter.value == pytest.approx(math.sqrt(6), abs=1e-12)
    with pytest.raises(
        InvalidUpdateError, match=r"update norm 5.09902 is over max_update_norm 5 .*up to 'b'"
    ):
        meter.add("b", torch.full((4,), math.sqrt(5.0), dtype=torch.float64))  # 6 + 20 = 26
    with pytest.raises(InvalidUpdateError, match=r"update norm 7.34847e\+38"):
        bounds.check_update({"w": torch.full((2, 3), 3e38)}, BASE)  # 3e38 squared stays finite in float64


def test_labels_and_escaping():
    assert check_label("Zürich 7/10 @eu:a_b", what="name", limit=128)
    for bad, char in [
        ("a\nb", "'\\n'"),
        ("a\x1b[31m", "'\\x1b'"),
        ("a\u202eb", "'\\u202e'"),
        ("a\tb", "'\\t'"),
    ]:
        with pytest.raises(InvalidUpdateError) as err:
            check_label(bad, what="name", limit=128)
        assert f"name: character 1 is {char}; only printable characters" in str(err.value)
    assert escape("x\n\x1b[0m") == "'x\\n\\x1b[0m'"
    assert escape("a" * 10, limit=4) == "'aaaa'...(+6 chars)"


def test_first_non_finite_names_the_path():
    assert first_non_finite({"global_state": BASE, "opt": {"buffers": {"v": {"w": torch.ones(2)}}}}) is None
    state = {"global_state": BASE, "opt": {"buffers": {"v": {"w": torch.tensor([1.0, math.inf])}}}}
    assert first_non_finite(state) == "opt.buffers.v.w"
    assert first_non_finite([torch.tensor([math.nan], dtype=torch.bfloat16)]) == "0"


class Shift(Client):
    def __init__(self, name, by, *, claim=3, poisoned=()):
        self.name, self.by, self.claim, self.poisoned = name, by, claim, poisoned

    @property
    def num_examples(self):
        return 3

    def fit(self, state, ins):
        value = (
            (lambda v: torch.full_like(v, 3e38)) if ins.round in self.poisoned else (lambda v: v + self.by)
        )
        return FitOutput(
            OrderedDict((n, value(v) if v.is_floating_point() else v) for n, v in state.items()),
            num_examples=self.claim,
        )


def _engine(clients, *, rounds, bounds=None, store=None):
    strategy = build_strategy_from("fedadam", seed=0)
    strategy.initialize(initial_state=OrderedDict(w=torch.ones(2, 3), steps=torch.tensor(1)))
    return RoundEngine(
        strategy=strategy,
        fleet=InProcessFleet(clients, bounds=bounds),
        schedule=Schedule(
            rounds=rounds,
            min_clients=1,
            round_timeout=timedelta(seconds=5),
            join_timeout=timedelta(seconds=5),
        ),
        io=RunIO(
            store=store,
        ),
    )


def test_in_process_fleet_refuses_what_the_coordinator_refuses():
    clients = [Shift("a", 0.1), Shift("greedy", 0.2, claim=4), Shift("far", 10.0)]
    engine = _engine(clients, rounds=1, bounds=UpdateBounds(max_update_norm=1.0))
    engine.run()
    assert engine.history[0].clients_ok == 1
    outcome = engine.fleet.fit_round(
        server_round=2,
        global_state=engine.strategy.global_state,
        assignments=[
            (info, engine.strategy.configure_round(server_round=2, clients=[info])[0][1])
            for info in engine.fleet.wait_for_clients(min_clients=1, timeout=timedelta(seconds=1))
        ],
        timeout=timedelta(seconds=5),
    )
    reasons = {f.client.name: f.reason for f in outcome.failures}
    assert "the update claims 4, the client reported 3 at join" in reasons["greedy"]
    assert "update norm 24.4949 is over max_update_norm 1" in reasons["far"]
    with pytest.raises(InvalidUpdateError, match="name: character 1 is '\\\\n'"):
        InProcessFleet([Shift("x\ny", 0.1)])


def test_a_non_finite_round_fails_keeps_the_state_and_writes_no_checkpoint(tmp_path):
    store = StateStore(tmp_path)
    poisoned = _engine(
        [Shift("a", 0.1), Shift("b", 0.2, poisoned=(2,)), Shift("c", 0.3, poisoned=(2,))],
        rounds=3,
        store=store,
    )
    poisoned.run()
    assert [m.extra.get(ROUND_FAILED, 0.0) for m in poisoned.history] == [0.0, 1.0, 0.0]
    assert [r for r, _ in store.checkpoints()] == [3, 1]
    assert [h["round"] for h in store.history()] == [1, 2, 3]  # the failed round is in the history, marked
    clean = _engine([Shift("a", 0.1), Shift("b", 0.2), Shift("c", 0.3)], rounds=3)
    for r in (1, 3):
        clean.commit(clean.run_round(r))
    for name, tensor in clean.strategy.global_state.items():
        assert torch.equal(poisoned.strategy.global_state[name], tensor), name
    assert poisoned.strategy.state_dict()["server_optimizer"]["steps"] == 2
