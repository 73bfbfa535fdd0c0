"""Unit tests of ``fedgrid.aggregation.server_opt``: each optimizer against hand-computed steps."""

from __future__ import annotations

import io
import math
from collections import OrderedDict

import pytest
import torch

from fedgrid.aggregation import ServerAdagrad, ServerAdam, ServerSGD, ServerYogi


def _od(**tensors: torch.Tensor) -> "OrderedDict[str, torch.Tensor]":
    return OrderedDict(tensors)


def _f64(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-12, atol=1e-12)


def test_sgd_plain_step():
    opt = ServerSGD(lr=0.5)
    out = opt.step(global_state=_od(w=_f64(1.0, 2.0)), pseudo_grad=_od(w=_f64(0.2, -0.4)))
    _close(out["w"], [0.9, 2.2])  # x - lr * g


def test_sgd_lr_one_is_fedavg():
    # pseudo_grad = global - mean(clients), so x - g = mean(clients)
    glob, mean = _f64(1.0, -3.0), _f64(0.25, 4.0)
    out = ServerSGD(lr=1.0).step(global_state=_od(w=glob), pseudo_grad=_od(w=glob - mean))
    assert torch.equal(out["w"], mean)


def test_momentum_two_steps_hand_computed():
    opt = ServerSGD(lr=1.0, momentum=0.9)
    x = _od(w=_f64(0.0, 0.0))
    x = opt.step(global_state=x, pseudo_grad=_od(w=_f64(1.0, 2.0)))  # b = g = [1, 2]
    _close(x["w"], [-1.0, -2.0])
    x = opt.step(global_state=x, pseudo_grad=_od(w=_f64(1.0, 0.0)))  # b = 0.9 b + g = [1.9, 1.8]
    _close(x["w"], [-2.9, -3.8])


def test_nesterov_two_steps_hand_computed():
    opt = ServerSGD(lr=1.0, momentum=0.9, nesterov=True)
    x = _od(w=_f64(0.0, 0.0))
    x = opt.step(global_state=x, pseudo_grad=_od(w=_f64(1.0, 2.0)))  # b = [1, 2]; d = g + 0.9 b = [1.9, 3.8]
    _close(x["w"], [-1.9, -3.8])
    x = opt.step(global_state=x, pseudo_grad=_od(w=_f64(1.0, 0.0)))  # b = [1.9, 1.8]; d = [2.71, 1.62]
    _close(x["w"], [-4.61, -5.42])


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_matches_torch_sgd(nesterov):
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(5, 4, generator=gen)
    grads = [torch.randn(5, 4, generator=gen) for _ in range(4)]
    param = torch.nn.Parameter(start.clone())
    ref = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=nesterov)
    opt = ServerSGD(lr=0.7, momentum=0.9, nesterov=nesterov)
    x = _od(w=start.clone())
    for g in grads:
        param.grad = g.clone()
        ref.step()
        x = opt.step(global_state=x, pseudo_grad=_od(w=g))
        assert torch.equal(x["w"], param.detach())  # same ops in the same order: bit-identical


def test_adam_two_steps_hand_computed():
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 0.01
    opt = ServerAdam(lr=lr, beta1=b1, beta2=b2, tau=tau)
    x = opt.step(global_state=_od(w=_f64(1.0)), pseudo_grad=_od(w=_f64(0.5)))
    m1 = (1 - b1) * 0.5  # m starts at 0
    v1 = b2 * tau**2 + (1 - b2) * 0.25  # v starts at tau^2; no bias correction
    x1 = 1.0 - lr * m1 / (math.sqrt(v1) + tau)
    _close(x["w"], [x1])
    x = opt.step(global_state=x, pseudo_grad=_od(w=_f64(-2.0)))
    m2 = b1 * m1 + (1 - b1) * -2.0
    v2 = b2 * v1 + (1 - b2) * 4.0
    _close(x["w"], [x1 - lr * m2 / (math.sqrt(v2) + tau)])


def test_adam_round_numbers():
    # beta1 = beta2 = 0: m = g, v = g^2, so x - lr * g / (|g| + tau) = 2 - 3 / (3 + 1)
    out = ServerAdam(lr=1.0, beta1=0.0, beta2=0.0, tau=1.0).step(
        global_state=_od(w=_f64(2.0)), pseudo_grad=_od(w=_f64(3.0))
    )
    _close(out["w"], [1.25])


def test_yogi_two_steps_hand_computed():
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 0.01
    opt = ServerYogi(lr=lr, beta1=b1, beta2=b2, tau=tau)
    x = opt.step(global_state=_od(w=_f64(1.0, 1.0)), pseudo_grad=_od(w=_f64(0.5, 0.001)))
    expected = []
    vs, ms = [], []
    for g in (0.5, 0.001):
        m = (1 - b1) * g
        v0 = tau**2
        v = v0 - (1 - b2) * g * g * math.copysign(1.0, v0 - g * g)  # g=0.5: v grows; g=0.001: v shrinks
        ms.append(m)
        vs.append(v)
        expected.append(1.0 - lr * m / (math.sqrt(v) + tau))
    assert vs[0] > tau**2 and vs[1] < tau**2
    _close(x["w"], expected)
    x = opt.step(global_state=x, pseudo_grad=_od(w=_f64(0.5, 0.5)))
    second = []
    for i in range(2):
        m = b1 * ms[i] + (1 - b1) * 0.5
        v = vs[i] - (1 - b2) * 0.25 * math.copysign(1.0, vs[i] - 0.25)
        second.append(expected[i] - lr * m / (math.sqrt(v) + tau))
    _close(x["w"], second)


def test_yogi_sign_zero_keeps_v():
    # v - g^2 == 0 exactly: sign 0, v unchanged (tau = 0.5, g = 0.5)
    opt = ServerYogi(lr=1.0, beta1=0.0, beta2=0.5, tau=0.5)
    out = opt.step(global_state=_od(w=_f64(0.0)), pseudo_grad=_od(w=_f64(0.5)))
    _close(out["w"], [-0.5 / (0.5 + 0.5)])
    assert opt.state_dict()["buffers"]["v"]["w"].item() == 0.25


def test_adagrad_two_steps_hand_computed():
    opt = ServerAdagrad(lr=1.0, tau=1.0)  # beta1 = 0: m = g; v = 1 + sum g^2
    x = opt.step(
        global_state=_od(w=_f64(0.0)), pseudo_grad=_od(w=_f64(math.sqrt(3.0)))
    )  # v = 4, step sqrt3 / 3
    _close(x["w"], [-math.sqrt(3.0) / 3.0])
    x = opt.step(global_state=x, pseudo_grad=_od(w=_f64(math.sqrt(5.0))))  # v = 9, step sqrt5 / 4
    _close(x["w"], [-math.sqrt(3.0) / 3.0 - math.sqrt(5.0) / 4.0])


def test_adagrad_with_beta1():
    opt = ServerAdagrad(lr=1.0, beta1=0.5, tau=1.0)
    x = opt.step(global_state=_od(w=_f64(0.0)), pseudo_grad=_od(w=_f64(math.sqrt(3.0))))  # m = sqrt3/2, v = 4
    _close(x["w"], [-math.sqrt(3.0) / 2.0 / 3.0])


def test_partial_step_touches_only_named_tensors():
    opt = ServerAdam(lr=0.1)
    glob = _od(a=torch.ones(2), b=torch.ones(3), n=torch.tensor(7))
    out = opt.step(global_state=glob, pseudo_grad=_od(a=torch.ones(2)))
    assert list(out) == ["a", "b", "n"]
    assert out["b"] is glob["b"] and out["n"] is glob["n"]
    assert not torch.equal(out["a"], glob["a"])
    assert set(opt.state_dict()["buffers"]["m"]) == {"a"}
    assert glob["a"].tolist() == [1.0, 1.0]  # inputs untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_state_is_float32(dtype):
    opt = ServerSGD(lr=0.1, momentum=0.9)
    out = opt.step(global_state=_od(w=torch.ones(3, dtype=dtype)), pseudo_grad=_od(w=torch.full((3,), 1e-3)))
    assert out["w"].dtype == dtype
    assert opt.state_dict()["buffers"]["momentum"]["w"].dtype == torch.float32


def test_step_rejects_integer_unknown_and_misshaped():
    opt = ServerSGD()
    with pytest.raises(ValueError, match="only real floating tensors"):
        opt.step(global_state=_od(n=torch.tensor([1])), pseudo_grad=_od(n=torch.tensor([1.0])))
    with pytest.raises(ValueError, match="does not hold"):
        opt.step(global_state=_od(w=torch.ones(1)), pseudo_grad=_od(x=torch.ones(1)))
    with pytest.raises(ValueError, match=r"shape \[2\], the model \[1\]"):
        opt.step(global_state=_od(w=torch.ones(1)), pseudo_grad=_od(w=torch.ones(2)))


@pytest.mark.parametrize(
    "factory",
    [
        lambda: ServerSGD(lr=0.0),
        lambda: ServerSGD(lr=-1.0),
        lambda: ServerSGD(momentum=1.0),
        lambda: ServerSGD(nesterov=True),
        lambda: ServerAdam(beta1=1.0),
        lambda: ServerYogi(beta2=-0.1),
        lambda: ServerAdagrad(tau=0.0),
        lambda: ServerAdam(lr=math.inf),
    ],
)
def test_bad_hyperparameters_raise(factory):
    with pytest.raises(ValueError):
        factory()


@pytest.mark.parametrize(
    "factory",
    [
        lambda: ServerSGD(lr=0.3, momentum=0.9, nesterov=True),
        lambda: ServerAdam(lr=0.05),
        lambda: ServerYogi(lr=0.05),
        lambda: ServerAdagrad(lr=0.05, beta1=0.5),
    ],
)
def test_state_dict_round_trip_is_bit_identical(factory):
    gen = torch.Generator().manual_seed(1)
    grads = [_od(w=torch.randn(6, generator=gen), b=torch.randn(2, generator=gen)) for _ in range(5)]
    x0 = _od(w=torch.zeros(6), b=torch.zeros(2))
    straight, x = factory(), x0
    for g in grads:
        x = straight.step(global_state=x, pseudo_grad=g)

    first, y = factory(), x0
    for g in grads[:2]:
        y = first.step(global_state=y, pseudo_grad=g)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = factory()
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for g in grads[2:]:
        y = resumed.step(global_state=y, pseudo_grad=g)
    for name in x:
        assert torch.equal(x[name], y[name])
    assert resumed.steps == straight.steps == 5


def test_state_dict_is_a_copy_and_kind_is_checked():
    opt = ServerSGD(lr=1.0, momentum=0.5)
    opt.step(global_state=_od(w=torch.zeros(1)), pseudo_grad=_od(w=torch.ones(1)))
    state = opt.state_dict()
    opt.step(global_state=_od(w=torch.zeros(1)), pseudo_grad=_od(w=torch.ones(1)))
    assert state["buffers"]["momentum"]["w"].tolist() == [1.0]
    with pytest.raises(ValueError, match="kind 'sgd'"):
        ServerAdam().load_state_dict(state)
    fresh = ServerSGD(lr=1.0, momentum=0.5)
    fresh.load_state_dict(state)
    state["buffers"]["momentum"]["w"].add_(5.0)  # loading copies too
    assert fresh.state_dict()["buffers"]["momentum"]["w"].tolist() == [1.0]


@pytest.mark.parametrize(
    "make",
    [
        lambda: ServerSGD(lr=0.7, momentum=0.9, nesterov=True),
        lambda: ServerAdam(lr=0.1),
        lambda: ServerYogi(lr=0.1),
        lambda: ServerAdagrad(lr=0.1),
    ],
    ids=["nesterov", "adam", "yogi", "adagrad"],
)
def test_step_each_is_step_bit_for_bit_asking_each_gradient_once_in_order(make):
    """``step_each`` (FedOpt's streamed outer step) moves the model and the buffers exactly as
    ``step``, over two steps, asking for each tensor's pseudo-gradient once, in the given order."""
    gen = torch.Generator().manual_seed(3)
    model = OrderedDict(
        w=torch.randn(5, 4, generator=gen), b=torch.randn(4, generator=gen), n=torch.tensor(7)
    )
    grads = [
        OrderedDict(w=torch.randn(5, 4, generator=gen), b=torch.randn(4, generator=gen)) for _ in range(2)
    ]
    whole, streamed = make(), make()
    a = b = model
    for grad in grads:
        a = whole.step(global_state=a, pseudo_grad=grad)
        asked: list[str] = []

        def of(name: str, grad=grad) -> torch.Tensor:
            asked.append(name)
            return grad[name].clone()

        b = streamed.step_each(global_state=b, names=["w", "b"], pseudo_grad_of=of)
        assert asked == ["w", "b"]
    assert list(a) == list(b) == ["w", "b", "n"]
    assert all(torch.equal(a[k], b[k]) for k in a) and b["n"] is model["n"]
    sa, sb = whole.state_dict(), streamed.state_dict()
    assert sa["steps"] == sb["steps"] == 2
    assert all(
        torch.equal(sa["buffers"][k][n], sb["buffers"][k][n]) for k in sa["buffers"] for n in sa["buffers"][k]
    )


def test_step_each_refuses_a_gradient_of_another_shape_naming_it():
    opt = ServerSGD(lr=1.0)
    with pytest.raises(ValueError, match="pseudo-gradient of 'w' has shape \\[3\\], the model \\[2\\]"):
        opt.step_each(
            global_state={"w": torch.zeros(2)}, names=["w"], pseudo_grad_of=lambda n: torch.zeros(3)
        )
    assert opt.steps == 0
