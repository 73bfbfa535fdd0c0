"""Seams for nested rounds: a strategy adopts a model from outside; nested task ids never collide."""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta

import pytest
import torch

from fedgrid.aggregation import FedAvg
from fedgrid.aggregation.by_name import build_strategy_from
from fedgrid.aggregation.selection import Sampling
from fedgrid.clock import ManualClock
from fedgrid.errors import InvalidUpdateError
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.types import ClientInfo, FitIns, FitRes

from clocked import run_out


def _state(value: float) -> "OrderedDict[str, torch.Tensor]":
    return OrderedDict(
        [("w", torch.full((2, 3), value)), ("b", torch.full((2,), value)), ("steps", torch.tensor(3))]
    )


def test_fedavg_adopts_the_received_model():
    strategy = FedAvg(sampling=Sampling(seed=0))
    strategy.initialize(initial_state=_state(0.0))
    strategy.receive_global(state=_state(2.5))
    for name, tensor in _state(2.5).items():
        assert torch.equal(strategy.global_state[name], tensor)
    # The next round starts from it: one client sending 3.5 everywhere moves the mean there.
    info = ClientInfo(client_id="c", name="c", num_examples=1)
    strategy.aggregate(server_round=1, results=[FitRes(info, _state(3.5), 1, {})], failures=[])
    assert torch.equal(strategy.global_state["w"], torch.full((2, 3), 3.5))


def test_server_optimizer_state_starts_afresh():
    strategy = build_strategy_from("fedadam", seed=0, server_lr=0.1)
    strategy.initialize(initial_state=_state(0.0))
    info = ClientInfo(client_id="c", name="c", num_examples=1)
    strategy.aggregate(server_round=1, results=[FitRes(info, _state(1.0), 1, {})], failures=[])
    moved = strategy.state_dict()
    strategy.receive_global(state=_state(5.0))
    fresh = build_strategy_from("fedadam", seed=0, server_lr=0.1)
    fresh.initialize(initial_state=_state(5.0))
    assert _same(strategy.state_dict(), fresh.state_dict())  # as if it had started from the received model
    assert not _same(moved, strategy.state_dict())


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize(
    "bad,words",
    [
        (OrderedDict([("w", torch.zeros(2, 3)), ("b", torch.zeros(2))]), r"missing \['steps'\]"),
        (
            OrderedDict([("w", torch.zeros(3, 2)), ("b", torch.zeros(2)), ("steps", torch.tensor(1))]),
            r"tensor 'w' is torch.float32\(3, 2\)",
        ),
        (
            OrderedDict(
                [
                    ("w", torch.zeros(2, 3, dtype=torch.float64)),
                    ("b", torch.zeros(2)),
                    ("steps", torch.tensor(1)),
                ]
            ),
            "tensor 'w' is torch.float64",
        ),
        (
            OrderedDict(
                [("w", torch.full((2, 3), float("nan"))), ("b", torch.zeros(2)), ("steps", torch.tensor(1))]
            ),
            "tensor 'w' is not finite",
        ),
    ],
)
def test_a_received_model_that_does_not_fit_changes_nothing(bad, words):
    strategy = FedAvg(sampling=Sampling(seed=0))
    strategy.initialize(initial_state=_state(1.0))
    with pytest.raises(InvalidUpdateError, match=words):
        strategy.receive_global(state=bad)
    for name, tensor in _state(1.0).items():
        assert torch.equal(strategy.global_state[name], tensor)


def test_nested_rounds_get_distinct_task_ids():
    clock = ManualClock()
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60), clock=clock)
    info, _ = fleet.join(ClientInfo(client_id="", name="c", num_examples=1))
    ids = []
    for scope in ("g1", "g2"):
        fleet.task_scope = scope
        run_out(
            clock,
            lambda: fleet.fit_round(
                server_round=1,
                global_state=_state(0.0),
                assignments=[(info, FitIns(round=1))],
                timeout=timedelta(seconds=30),
            ),
        )
        ids.append(fleet.current_round.task_id)
        fleet.committed(1)
    assert ids[0] != ids[1] and "-g1-r1-fit" in ids[0] and "-g2-r1-fit" in ids[1]
    with pytest.raises(ValueError, match="task_scope"):
        fleet.task_scope = "g1\nr2"
    fleet.close()
