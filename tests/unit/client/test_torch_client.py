"""Unit tests of ``fedgrid.client.torch_client.TorchClient`` (with the built-in digits task)."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid.client.torch_client import TorchClient
from fedgrid.seeding import derive_seed
from fedgrid.simulation import tasks
from fedgrid.simulation.models import digits_mlp
from fedgrid.types import FitIns

CONFIG = {"local_epochs": 1, "lr": 0.1, "seed": 0, "round": 1}


@pytest.fixture(scope="module")
def init_state():
    return tasks.initial_state(digits_mlp, seed=0)


def _client() -> TorchClient:
    return tasks.builtin_client(0, 3, seed=0, options=tasks.ClientOptions(device="cpu"))


def _copy(state):
    return OrderedDict((k, v.clone()) for k, v in state.items())


def _assert_states_equal(a, b):
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_fit_is_reproducible(init_state):
    client = _client()
    first = client.fit(_copy(init_state), FitIns(round=1, config=dict(CONFIG)))
    second = client.fit(_copy(init_state), FitIns(round=1, config=dict(CONFIG)))
    third = _client().fit(
        _copy(init_state), FitIns(round=1, config=dict(CONFIG))
    )  # a fresh process would do this
    _assert_states_equal(first.state, second.state)
    _assert_states_equal(first.state, third.state)
    assert first.metrics == second.metrics == third.metrics
    assert not torch.equal(first.state["0.weight"], init_state["0.weight"])  # it trained


def test_fit_differs_for_another_round(init_state):
    client = _client()
    one = client.fit(_copy(init_state), FitIns(round=1, config=dict(CONFIG)))
    two = client.fit(_copy(init_state), FitIns(round=2, config={**CONFIG, "round": 2}))
    assert not torch.equal(one.state["0.weight"], two.state["0.weight"])
    other_seed = client.fit(_copy(init_state), FitIns(round=1, config={**CONFIG, "seed": 1}))
    assert not torch.equal(one.state["0.weight"], other_seed.state["0.weight"])


def test_fit_leaves_global_rng_alone(init_state):
    client = _client()
    torch.manual_seed(12345)
    before = torch.get_rng_state()
    client.fit(_copy(init_state), FitIns(round=1, config=dict(CONFIG)))
    assert torch.equal(torch.get_rng_state(), before)


def test_fit_reports_examples_and_loss(init_state):
    client = _client()
    out = client.fit(_copy(init_state), FitIns(round=1, config={**CONFIG, "local_epochs": 2}))
    assert out.num_examples == len(client.train_loader.dataset) == client.num_examples
    assert out.num_examples > 0
    assert math.isfinite(out.metrics["loss"]) and 0.0 < out.metrics["loss"] < 2 * math.log(10)
    assert {k: (v.dtype, v.shape) for k, v in out.state.items()} == {
        k: (v.dtype, v.shape) for k, v in init_state.items()
    }


def test_fit_does_not_modify_input_and_output_is_detached(init_state):
    client = _client()
    given = _copy(init_state)
    out = client.fit(given, FitIns(round=1, config=dict(CONFIG)))
    _assert_states_equal(given, init_state)
    out.state["0.weight"].add_(1.0)  # the result is a copy, not the client's live parameters
    assert not torch.equal(client.model.state_dict()["0.weight"], out.state["0.weight"])


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "scaffold"])
def test_fit_keeps_no_gradients_between_rounds(init_state, algorithm):
    """A client between rounds holds its weights, not a second copy of them as ``.grad``."""
    client = _client()
    config = (
        {**CONFIG, "algorithm": algorithm, "mu": 0.1}
        if algorithm == "fedprox"
        else {**CONFIG, "algorithm": algorithm}
    )
    out = client.fit(_copy(init_state), FitIns(round=1, config=config))
    assert not torch.equal(out.state["0.weight"], init_state["0.weight"])  # it trained
    assert [name for name, p in client.model.named_parameters() if p.grad is not None] == []


def test_fit_lr_zero_leaves_weights(init_state):
    out = _client().fit(_copy(init_state), FitIns(round=1, config={**CONFIG, "lr": 0.0}))
    _assert_states_equal(out.state, init_state)


def test_fit_rejects_zero_epochs(init_state):
    with pytest.raises(ValueError, match="local_epochs must be at least 1, got 0"):
        _client().fit(_copy(init_state), FitIns(round=1, config={**CONFIG, "local_epochs": 0}))


def test_evaluate_accuracy_in_unit_interval(init_state):
    client = _client()
    out = client.evaluate(_copy(init_state), {})
    assert out.num_examples == len(client.eval_loader.dataset)
    assert 0.0 <= out.metrics["accuracy"] <= 1.0
    assert math.isfinite(out.metrics["loss"]) and out.metrics["loss"] > 0.0
    trained = client.fit(_copy(init_state), FitIns(round=1, config={**CONFIG, "local_epochs": 3}))
    after = client.evaluate(trained.state, {})
    assert 0.0 <= after.metrics["accuracy"] <= 1.0
    assert after.metrics["loss"] < out.metrics["loss"]


def _linear_client(x, y, **kw) -> TorchClient:
    model = nn.Linear(1, 1, bias=False)
    return TorchClient(
        model,
        DataLoader(TensorDataset(x, y), batch_size=max(len(x), 1)),
        nn.functional.mse_loss,
        lambda params: torch.optim.SGD(params, lr=0.1),
        device="cpu",
        **kw,
    )


def test_fit_hand_computed_sgd_step():
    x = torch.tensor([[1.0], [2.0]])
    client = _linear_client(x, x.clone(), eval_loader=[(x, 2 * x)])
    out = client.fit(OrderedDict(weight=torch.zeros(1, 1)), FitIns(round=1))
    # L = mean((w x - x)^2) at w=0 is 2.5; dL/dw = mean(2 (w x - x) x) = -5; w <- 0 - 0.1 * -5
    assert out.state["weight"].item() == pytest.approx(0.5, abs=1e-7)
    assert out.num_examples == 2
    assert out.metrics == {"loss": pytest.approx(2.5, abs=1e-7)}
    ev = client.evaluate(OrderedDict(weight=torch.ones(1, 1)), {})
    # targets are 2x, predictions x: mean(x^2) = 2.5
    assert ev.num_examples == 2 and ev.metrics["loss"] == pytest.approx(2.5, abs=1e-7)


def test_evaluate_regression_has_no_accuracy():
    x = torch.tensor([[1.0], [2.0]])
    ev = _linear_client(x, x.clone(), eval_loader=[(x, x.clone())]).evaluate(
        OrderedDict(weight=torch.ones(1, 1)), {}
    )
    assert ev.metrics == {"loss": 0.0}


def test_fit_without_data_or_eval_raises():
    client = _linear_client(torch.empty(0, 1), torch.empty(0, 1))
    with pytest.raises(ValueError, match="has no training data"):
        client.fit(OrderedDict(weight=torch.zeros(1, 1)), FitIns(round=1))
    with pytest.raises(NotImplementedError, match="no evaluation data"):
        client.evaluate(OrderedDict(weight=torch.zeros(1, 1)), {})


def test_derive_seed_is_stable_and_63_bit():
    a = derive_seed(0, 1, 0, "digits-0000/3")
    assert a == derive_seed(0, 1, 0, "digits-0000/3")
    assert 0 <= a < 2**63
    assert len({derive_seed(0, r, 0, "n") for r in range(100)}) == 100
    assert derive_seed(1, 0) != derive_seed(0, 1)


def test_digits_client_name_and_partition_bounds():
    assert _client().name == "digits-0000/3"
    with pytest.raises(ValueError, match="index 3 is outside 0..2"):
        tasks.builtin_client(3, 3, seed=0)
