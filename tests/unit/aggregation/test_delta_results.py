"""Results that hold deltas (``FitRes.delta``, docs/updates.rst): pseudo-gradient strategies take
the difference as sent, with no add-back and subtract; plain FedAvg gets the model it always
got, bit for bit."""

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


def test_plain_fedavg_averages_the_same_models_from_deltas():
    deltas = _results()
    models = [as_model(_global(), r) for r in deltas]
    from_deltas, from_models = _aggregate(FedAvg(), deltas), _aggregate(FedAvg(), models)
    for name, tensor in from_models.items():
        assert torch.equal(from_deltas[name], tensor), name


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
