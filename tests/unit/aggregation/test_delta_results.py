"""Results that hold deltas (``FitRes.delta``, docs/updates.rst): pseudo-gradient strategies take
the difference as sent, with no add-back and subtract; plain FedAvg averages the differences as
sent and adds their mean to the model once."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.fedopt import FedAvgM
from fedgrid.aggregation.robust import Median
from fedgrid.aggregation.updates import as_model, client_delta, client_value
from fedgrid.types import ClientInfo, FitRes

pytestmark = pytest.mark.timeout(60)


def _global():
    g = torch.Generator().manual_seed(0)
    return OrderedDict(
        w=torch.randn(64, 33, generator=g) * 100, b=torch.randn(7, generator=g), steps=torch.tensor(3)
    )


def _deltas(seed):
    g = torch.Generator().manual_seed(seed)
    # Small against the global values: global + delta rounds in float32.
    return OrderedDict(
        w=torch.randn(64, 33, generator=g) * 1e-3,
        b=torch.randn(7, generator=g) * 1e-3,
        steps=torch.tensor(3 + seed),
    )


def _results(n=3):
    return [
        FitRes(ClientInfo(f"c{i}", name=f"c{i}"), _deltas(i + 1), 10 + i, {}, delta=True) for i in range(n)
    ]


def test_a_delta_result_is_its_own_delta_unrounded():
    glob, [res] = _global(), _results(1)
    got = client_delta(glob, res, ["w", "b"])
    assert torch.equal(got["w"], res.state["w"]) and torch.equal(got["b"], res.state["b"])
    # The old path (the model in float32, then minus the global model) rounds.
    model = as_model(glob, res)
    old = client_delta(glob, model, ["w"])["w"]
    assert not model.delta and not torch.equal(old, res.state["w"])
    torch.testing.assert_close(
        old, res.state["w"], rtol=0, atol=2e-5
    )  # half a float32 ulp of |global| <= 400


def test_as_model_adds_the_global_model_back_to_floating_tensors_only():
    glob, [res] = _global(), _results(1)
    model = as_model(glob, res)
    assert torch.equal(model.state["w"], glob["w"] + res.state["w"])
    assert torch.equal(model.state["steps"], res.state["steps"])
    assert model.num_examples == res.num_examples and model.client == res.client
    plain = FitRes(res.client, model.state, 3)
    assert as_model(glob, plain) is plain
    part = client_value(glob, res, "w", slice(5, 50))
    assert torch.equal(part, (glob["w"] + res.state["w"]).reshape(-1)[5:50])


def _aggregate(strategy, results):
    strategy.initialize(initial_state=_global())
    strategy.aggregate(server_round=1, results=results, failures=[])
    return strategy.global_state


def test_plain_fedavg_adds_the_mean_of_the_deltas_as_sent():
    """No add-back per client (issue 39: an update changes form at most once): the example-
    weighted mean of the deltas (float64 accumulator), added once to the global model."""
    deltas = _results()
    glob = _global()
    from_deltas = _aggregate(FedAvg(), deltas)
    for name in ("w", "b"):
        acc = torch.zeros(glob[name].shape, dtype=torch.float64)
        for r in deltas:
            acc.add_(r.state[name], alpha=r.mean_weight)
        mean = acc.div_(sum(r.mean_weight for r in deltas)).to(torch.float32)
        assert torch.equal(from_deltas[name], glob[name] + mean), name
    # The models the old path averaged give the same within the rounding of global + delta.
    from_models = _aggregate(FedAvg(), [as_model(_global(), r) for r in deltas])
    torch.testing.assert_close(from_deltas["w"], from_models["w"], rtol=0, atol=3.1e-5)  # 1 ulp at |w| <= 400
    assert torch.equal(from_deltas["steps"], from_models["steps"])  # integers: the mean of the values


@pytest.mark.parametrize(
    "make", [lambda: FedAvg(aggregator=Median()), lambda: FedAvgM(server_lr=1.0, server_momentum=0.0)]
)
def test_pseudo_gradient_strategies_take_the_deltas_as_sent(make):
    deltas = _results()
    got = _aggregate(make(), deltas)
    glob = _global()
    # What the aggregate of the unrounded deltas gives, applied once to the global model.
    if isinstance(make(), FedAvgM):
        total = sum(r.num_examples for r in deltas)
        mean = sum(r.state["w"].double() * r.num_examples for r in deltas) / total
    else:
        mean = torch.stack([r.state["w"] for r in deltas]).median(dim=0).values.double()
    torch.testing.assert_close(got["w"].double(), glob["w"].double() + mean, rtol=0, atol=2e-5)
    assert FedAvg.accepts_deltas and FedAvgM.accepts_deltas
