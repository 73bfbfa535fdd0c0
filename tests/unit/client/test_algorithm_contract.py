"""The client-algorithm contract (``fedgrid.client.algorithms``): the registry, each built-in's
hooks against hand-computed numbers, a new algorithm run through ``TorchClient`` and the
batched engine, and the per-step hooks on sharded (``DTensor``) parameters."""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from typing import Any, Iterator, Mapping, Sequence

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid.aggregation.scaffold import CONTROL_DELTA_PREFIX, CONTROL_PREFIX
from fedgrid.client.algorithms import (
    ALGORITHMS,
    BlockCoordinateTraining,
    ClientAlgorithm,
    DiLoCoTraining,
    FedAvgTraining,
    FedProxTraining,
    FitContext,
    Loop,
    ProximalTerm,
    ScaffoldTraining,
    algorithm_of,
    like,
    register,
)
from fedgrid.client.torch_client import TorchClient
from fedgrid.simulation.batched import BatchedTrainer
from fedgrid.types import FitIns, ModelState

X = torch.tensor([[1.0], [2.0]])
NAMES = ("0.weight", "0.bias", "2.weight", "2.bias")


def _ctx(**config: Any) -> FitContext:
    return FitContext(config=config, model=NAMES, client="c")


def _linear_client(**kw: Any) -> TorchClient:
    """``y = w x`` on x = (1, 2), targets x: at w = 0 the MSE gradient is -5 (hand-computed)."""
    return TorchClient(
        nn.Linear(1, 1, bias=False),
        DataLoader(TensorDataset(X, X.clone()), batch_size=2),
        nn.functional.mse_loss,
        lambda params: torch.optim.SGD(params, lr=0.1),
        device="cpu",
        **kw,
    )


def _zero() -> ModelState:
    return OrderedDict(weight=torch.zeros(1, 1))


# -- the registry --------------------------------------------------------------------------
def test_registry_maps_every_builtin_and_refuses_a_nameless_or_taken_name():
    assert list(ALGORITHMS) == ["fedavg", "fedprox", "scaffold", "diloco", "streaming-diloco", "bcd"]
    assert ALGORITHMS["bcd"] is BlockCoordinateTraining and algorithm_of({}) == "fedavg"
    with pytest.raises(
        ValueError, match="task asks for algorithm 'nope'; this client implements fedavg, fedprox, scaffold"
    ):
        algorithm_of({"algorithm": "nope"})
    with pytest.raises(ValueError, match="task asks for algorithm 'nope'"):
        _linear_client().algorithm("nope")

    class Nameless(ClientAlgorithm):
        pass

    class Impostor(ClientAlgorithm):
        name = "fedprox"

    with pytest.raises(ValueError, match="Nameless has no name"):
        register(Nameless)
    with pytest.raises(ValueError, match="algorithm 'fedprox' is already FedProxTraining's"):
        register(Impostor)
    assert (
        register(FedProxTraining) is FedProxTraining and ALGORITHMS["fedprox"] is FedProxTraining
    )  # registering again is a no-op


def test_which_builtins_the_batched_engine_trains():
    assert {name: cls.not_batchable for name, cls in ALGORITHMS.items()} == {
        "fedavg": None,
        "fedprox": None,
        "scaffold": None,
        "bcd": None,
        "diloco": "a persistent inner optimizer per client",
        "streaming-diloco": "a persistent inner optimizer and replica per client",
    }

    class OwnStep(
        FedAvgTraining
    ):  # a step hook the batched engine cannot see: sequential unless it says otherwise
        name = "own-step"

        def after_backward(self, *, params: Mapping[str, nn.Parameter]) -> None:
            pass

    assert (
        OwnStep.not_batchable
        == "OwnStep.after_backward has no batched form (set not_batchable = None once proximal_mu/correction state it)"
    )


# -- each built-in's hooks, against numbers ------------------------------------------------
def test_loop_lengths_and_their_errors():
    assert FedAvgTraining().loop(ctx=_ctx()) == Loop(epochs=1, steps=0)
    assert BlockCoordinateTraining().loop(ctx=_ctx(local_epochs=3)) == Loop(3, 0)
    assert DiLoCoTraining().loop(ctx=_ctx(inner_steps=7, local_epochs=3)) == Loop(0, 7)
    with pytest.raises(ValueError, match="local_epochs must be at least 1, got 0"):
        FedProxTraining().loop(ctx=_ctx(local_epochs=0))
    with pytest.raises(ValueError, match="inner_steps must be at least 1, got 0"):
        DiLoCoTraining().loop(ctx=_ctx())


def test_bcd_trains_sends_and_optimizes_the_block_only():
    bcd, ctx = BlockCoordinateTraining(), _ctx(block_prefixes="2")
    assert bcd.trained(names=list(NAMES), ctx=ctx) == ["2.weight", "2.bias"]
    assert FedAvgTraining().trained(names=list(NAMES), ctx=ctx) == list(NAMES)
    state = OrderedDict((n, torch.full((1,), float(i))) for i, n in enumerate(NAMES))
    assert list(bcd.upload(state=state, trained=["2.weight", "2.bias"], ctx=ctx)) == ["2.weight", "2.bias"]
    with pytest.raises(ValueError, match="'block_prefixes' = '9' matches no tensor"):
        bcd.trained(names=list(NAMES), ctx=_ctx(block_prefixes="9"))
    client = _linear_client()
    model, block = list(client.model.parameters()), [nn.Parameter(torch.zeros(1))]
    assert (
        bcd.optimizer(trainer=client, params=block, ctx=ctx).param_groups[0]["params"] == block
    )  # the block's alone
    assert (
        FedAvgTraining().optimizer(trainer=client, params=block, ctx=ctx).param_groups[0]["params"] == model
    )  # the whole model
    assert (
        DiLoCoTraining().optimizer(trainer=client, params=block, ctx=ctx) is client.inner_optimizer
    )  # kept across rounds


def test_scaffold_hooks_split_correct_and_upload_deltas():
    scaffold, ctx = ScaffoldTraining(), FitContext(config={}, model=("weight",))
    download = OrderedDict(weight=torch.zeros(1, 1))
    download[CONTROL_PREFIX + "weight"] = torch.full((1, 1), 2.0)
    assert list(scaffold.start(download=download, ctx=ctx)) == ["weight"]
    w = nn.Parameter(torch.zeros(1, 1))
    scaffold.begin(params={"weight": w}, ctx=ctx)
    assert scaffold.correction["weight"].item() == 2.0  # c - c_i, c_i = 0 at first
    for g in (-5.0, -3.0):  # two steps' raw gradients
        w.grad = torch.full((1, 1), g)
        scaffold.after_backward(params={"weight": w})
        assert w.grad.item() == g + 2.0
    out = scaffold.upload(state=OrderedDict(weight=torch.ones(1, 1)), trained=["weight"], ctx=ctx)
    assert list(out) == ["weight", CONTROL_DELTA_PREFIX + "weight"]
    assert out[CONTROL_DELTA_PREFIX + "weight"].item() == -4.0  # c_i+ = mean raw gradient, minus c_i = 0
    assert scaffold.state_dict()["scaffold"]["c_i"]["weight"].item() == -4.0

    # The batched engine's form: it corrects gradients itself and records their raw sum.
    engine = ScaffoldTraining()
    engine.start(download=download, ctx=ctx)
    engine.begin(params={"weight": w}, ctx=ctx)
    engine.record(name="weight", grad_sum=torch.full((1, 1), -8.0), count=2)
    assert (
        engine.upload(state=OrderedDict(weight=torch.ones(1, 1)), trained=["weight"], ctx=ctx)[
            CONTROL_DELTA_PREFIX + "weight"
        ].item()
        == -4.0
    )


def test_fedprox_hook_adds_mu_times_the_drift_from_the_start():
    prox = FedProxTraining()
    assert (
        prox.proximal_mu(ctx=_ctx(proximal_mu=0.25)) == 0.25
        and FedAvgTraining().proximal_mu(ctx=_ctx(proximal_mu=0.25)) == 0.0
    )
    with pytest.raises(ValueError, match="proximal_mu must be non-negative and finite, got -1.0"):
        prox.begin(params={}, ctx=_ctx(proximal_mu=-1.0))
    w = nn.Parameter(torch.tensor([1.0, -2.0]))
    prox.begin(params={"w": w}, ctx=_ctx(proximal_mu=0.5))
    w.grad = torch.tensor([0.25, 0.25])
    prox.after_backward(params={"w": w})  # first step: anchored here, before anything moved
    assert w.grad.tolist() == [0.25, 0.25]
    with torch.no_grad():
        w.add_(torch.tensor([2.0, -4.0]))
    w.grad = None  # a parameter without a loss gradient gets the term's alone
    prox.after_backward(params={"w": w})
    assert w.grad.tolist() == [1.0, -2.0]  # 0.5 * (w - w_start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_proximal_gradient_is_bit_identical_to_back_propagating_the_term(dtype):
    """What FedProx did before the hook: ``(loss + term()).backward()``; same bits, every dtype."""

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).to(dtype)

    x, y = torch.randn(7, 3, 8, 8, generator=torch.Generator().manual_seed(1)).to(dtype), torch.arange(7) % 5
    models = [model(), model()]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9) for m in models]
    for mu in (1e-3, 0.01, 0.37):
        terms = [ProximalTerm(list(m.parameters()), mu) for m in models]
        for _ in range(3):
            for k, (m, opt, term) in enumerate(zip(models, optimizers, terms)):
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(m(x), y)
                if k == 0:
                    (loss + term()).backward()
                else:
                    loss.backward()
                    term.add_gradients()
                opt.step()
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(p, q)
        assert not torch.equal(terms[0].anchor[0], models[0][0].weight)  # it trained


def test_client_state_has_every_algorithms_keys_and_refuses_a_shared_key(_registered):
    client = _linear_client()
    assert set(client.state_dict()) == {
        "inner_optimizer",
        "lookahead",
        "scaffold",
        "diloco_replica",
        "replica",
        "test-drift",
    }

    class Squatter(FedAvgTraining):
        name = "test-squatter"

        def state_dict(self) -> dict[str, Any]:
            return {"replica": None}

    _registered.append(register(Squatter))
    with pytest.raises(
        ValueError, match="algorithm 'test-squatter' keeps state under 'replica', which another already uses"
    ):
        client.state_dict()


# -- a new algorithm, through TorchClient and the batched engine ---------------------------
class Drift(ClientAlgorithm):
    """A test algorithm in one class: each step adds ``drift`` to every gradient; keeps the sum of
    the raw gradients across rounds; sends the model and that sum."""

    name = "test-drift"
    not_batchable = None  # ``correction`` states the step hook for the batched engine

    def __init__(self) -> None:
        self.raw: dict[str, torch.Tensor] = {}
        self._drift: dict[str, torch.Tensor] = {}

    def begin(self, *, params: Mapping[str, nn.Parameter], ctx: FitContext) -> None:
        self._drift = {n: like(torch.full(p.shape, float(ctx.config["drift"])), p) for n, p in params.items()}

    def after_backward(self, *, params: Mapping[str, nn.Parameter]) -> None:
        for n, p in params.items():
            assert p.grad is not None
            self.record(name=n, grad_sum=p.grad.detach().float(), count=1)
            p.grad.add_(self._drift[n])

    @property
    def correction(self) -> Mapping[str, torch.Tensor]:
        return self._drift

    def record(self, *, name: str, grad_sum: torch.Tensor, count: int) -> None:
        self.raw[name] = self.raw.get(name, torch.zeros_like(grad_sum)) + grad_sum.cpu()

    def upload(self, *, state: ModelState, trained: Sequence[str], ctx: FitContext) -> ModelState:
        return OrderedDict([*state.items(), *((f"raw.{n}", t.clone()) for n, t in self.raw.items())])

    def state_dict(self) -> dict[str, Any]:
        return {"test-drift": {n: t.clone() for n, t in self.raw.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.raw = {n: t.clone() for n, t in (state.get("test-drift") or {}).items()}


@pytest.fixture
def _registered() -> Iterator[list[type[ClientAlgorithm]]]:
    extra: list[type[ClientAlgorithm]] = [register(Drift)]
    yield extra
    for cls in extra:
        ALGORITHMS.pop(cls.name, None)


def test_a_new_algorithm_runs_through_torch_client_hand_computed(_registered):
    client = _linear_client()
    ins = FitIns(round=1, config={"algorithm": "test-drift", "drift": 1.0, "local_epochs": 2})
    out = client.fit(_zero(), ins)
    # step 1 at w = 0: raw gradient -5, w = 0 - 0.1 * (-5 + 1) = 0.4; step 2: raw 2 (0.4 - 1) * 2.5 = -3,
    # w = 0.4 - 0.1 * (-3 + 1) = 0.6
    assert out.state["weight"].item() == pytest.approx(0.6, abs=1e-6)
    assert out.state["raw.weight"].item() == pytest.approx(-8.0, abs=1e-6)
    saved = client.state_dict()
    assert saved["test-drift"]["weight"].item() == pytest.approx(-8.0, abs=1e-6)
    resumed = _linear_client()
    resumed.load_state_dict(saved)
    assert torch.equal(
        resumed.fit(_zero(), ins).state["raw.weight"], client.fit(_zero(), ins).state["raw.weight"]
    )


def test_a_new_algorithm_trains_batched_as_through_fit(_registered, caplog):
    clients = [_linear_client(seed=i, name=f"c{i}") for i in range(3)]
    twins = copy.deepcopy(clients)
    trainer = BatchedTrainer(clients)
    assert trainer.reason is None, trainer.reason
    for r in (1, 2):
        ins = FitIns(round=r, config={"algorithm": "test-drift", "drift": 1.0, "local_epochs": 2})
        with caplog.at_level(logging.INFO):
            got = trainer.fit([(i, _zero(), ins) for i in range(3)])
        for batched, twin in zip(got, twins):
            want = twin.fit(_zero(), ins)
            assert not isinstance(batched, Exception), batched
            assert list(batched.state) == ["weight", "raw.weight"]
            assert batched.state["weight"].item() == pytest.approx(0.6, abs=1e-6)
            for name in want.state:
                torch.testing.assert_close(batched.state[name], want.state[name], atol=1e-6, rtol=0)
    assert clients[0].state_dict()["test-drift"]["weight"].item() == pytest.approx(
        -16.0, abs=1e-5
    )  # two rounds recorded
    assert not any("train sequentially" in r.message for r in caplog.records)  # it did train batched


def test_an_algorithm_with_a_step_hook_but_no_batched_form_trains_through_fit(_registered, caplog):
    class Halve(FedAvgTraining):
        name = "test-halve"

        def after_backward(self, *, params: Mapping[str, nn.Parameter]) -> None:
            for p in params.values():
                assert p.grad is not None
                p.grad.mul_(0.5)

    _registered.append(register(Halve))
    clients = [_linear_client(name="c0")]
    trainer = BatchedTrainer(clients)
    ins = FitIns(round=1, config={"algorithm": "test-halve"})
    with caplog.at_level(logging.INFO):
        got = trainer.fit([(0, _zero(), ins)])
    assert not isinstance(got[0], Exception)
    assert got[0].state["weight"].item() == pytest.approx(0.25, abs=1e-6)  # 0 - 0.1 * (-5 / 2)
    assert (
        sum(
            "test-halve clients train sequentially (Halve.after_backward has no batched form" in r.message
            for r in caplog.records
        )
        == 1
    )
