"""Unit tests of the model-averaging strategies: FedOpt family, DiLoCo, FedProx, SCAFFOLD."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from fedgrid.aggregation import (
    CONTROL_DELTA_PREFIX,
    CONTROL_PREFIX,
    DiLoCo,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedOpt,
    FedProx,
    FedYogi,
    Krum,
    Median,
    Scaffold,
    ServerAdam,
    ServerSGD,
)
from fedgrid.aggregation.selection import Sampling
from fedgrid.types import ClientInfo, Failure, FitIns, FitRes, TensorSpec

from aggsim import clients, fake_fit, model_state, run_round


def _res(name: str, num_examples: int, **tensors: torch.Tensor) -> FitRes:
    return FitRes(
        ClientInfo(client_id="id-" + name, name=name), OrderedDict(tensors), num_examples=num_examples
    )


def test_fedopt_sgd_lr_one_equals_fedavg():
    live = clients(4)
    fedavg, fedopt = FedAvg(), FedOpt(server_optimizer=ServerSGD(lr=1.0))
    for s in (fedavg, fedopt):
        s.initialize(initial_state=model_state())
    for server_round in (1, 2, 3):
        run_round(fedavg, server_round, live)
        run_round(fedopt, server_round, live)
        for name, t in fedavg.global_state.items():
            assert fedopt.global_state[name].dtype == t.dtype
            torch.testing.assert_close(fedopt.global_state[name], t, rtol=1e-6, atol=1e-6)
        assert torch.equal(
            fedopt.global_state["bn.num_batches_tracked"], fedavg.global_state["bn.num_batches_tracked"]
        )


def test_fedavgm_two_rounds_hand_computed():
    strategy = FedAvgM(server_lr=1.0, server_momentum=0.5)
    strategy.initialize(initial_state=OrderedDict(w=torch.tensor([0.0], dtype=torch.float64)))
    # round 1: the clients' weighted mean is 1 -> g = -1, b = -1, x = 1
    strategy.aggregate(
        server_round=1,
        results=[
            _res("a", 1, w=torch.tensor([0.0], dtype=torch.float64)),
            _res("b", 3, w=torch.tensor([4 / 3], dtype=torch.float64)),
        ],
        failures=[],
    )
    torch.testing.assert_close(
        strategy.global_state["w"], torch.tensor([1.0], dtype=torch.float64), rtol=1e-12, atol=1e-12
    )
    # round 2: mean 2 -> g = -1, b = 0.5 * -1 - 1 = -1.5, x = 2.5
    strategy.aggregate(
        server_round=2, results=[_res("a", 5, w=torch.tensor([2.0], dtype=torch.float64))], failures=[]
    )
    torch.testing.assert_close(
        strategy.global_state["w"], torch.tensor([2.5], dtype=torch.float64), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: (FedAdam(server_lr=0.05, server_tau=1e-2), ServerAdam(lr=0.05, tau=1e-2)),
        lambda: (FedOpt(server_optimizer=ServerAdam(lr=0.2)), ServerAdam(lr=0.2)),
    ],
    ids=["FedAdam", "FedOpt"],
)
def test_adaptive_strategy_steps_on_minus_weighted_mean_delta(make):
    strategy, reference = make()
    init = OrderedDict(w=torch.tensor([1.0, -1.0]), n=torch.tensor(3))
    strategy.initialize(initial_state=init)
    results = [
        _res("a", 1, w=torch.tensor([2.0, -1.0]), n=torch.tensor(5)),
        _res("b", 3, w=torch.tensor([1.0, 3.0]), n=torch.tensor(9)),
    ]
    strategy.aggregate(server_round=1, results=results, failures=[])
    mean_delta = torch.tensor([(1 * 1.0 + 3 * 0.0) / 4, (0.0 + 3 * 4.0) / 4])  # [0.25, 3]
    expected = reference.step(global_state=OrderedDict(w=init["w"]), pseudo_grad=OrderedDict(w=-mean_delta))
    assert torch.equal(strategy.global_state["w"], expected["w"])
    assert strategy.global_state["n"].item() == 8  # (5 + 27) / 4: integer buffers take the weighted mean


@pytest.mark.parametrize("cls", [FedAvgM, FedAdam, FedYogi, FedAdagrad])
def test_fedopt_family_moves_toward_clients_and_keeps_dtypes(cls):
    strategy = cls()
    strategy.initialize(initial_state=model_state())
    before = OrderedDict((k, v.clone()) for k, v in strategy.global_state.items())
    metrics = run_round(strategy, 1, clients(3))
    assert "train_loss" in metrics
    for name, t in strategy.global_state.items():
        assert t.dtype == before[name].dtype and t.shape == before[name].shape
        if t.dtype.is_floating_point:
            # fake clients drift by +0.05 on average: every server step moves the same way
            assert float((t.double() - before[name].double()).mean()) > 0, name


def test_robust_aggregator_precondition_failure_skips_round():
    strategy = FedAdam(aggregator=Krum(f=1))
    strategy.initialize(initial_state=model_state())
    before = strategy.state_dict()
    metrics = run_round(strategy, 1, clients(3))  # Krum with f = 1 needs 5 updates
    assert metrics["aggregation_skipped"] == 1.0 and "train_loss" in metrics
    after = strategy.state_dict()
    for name, t in before["global_state"].items():
        assert torch.equal(after["global_state"][name], t)
    assert after["server_optimizer"]["steps"] == 0


def test_check_preconditions_uses_clients_per_round():
    from fedgrid.errors import ConfigError

    FedAvg(aggregator=Krum(f=1)).check_preconditions(num_clients=5)
    with pytest.raises(ConfigError, match="needs more than 2f"):
        FedAvg(sampling=Sampling(fraction_fit=0.5), aggregator=Krum(f=1)).check_preconditions(
            num_clients=9
        )  # 4 per round
    FedAvg().check_preconditions(num_clients=1)


def test_fedavg_with_median_aggregates_deltas():
    strategy = FedAvg(aggregator=Median())
    strategy.initialize(initial_state=OrderedDict(w=torch.tensor([10.0])))
    results = [
        _res(n, k, w=torch.tensor([v])) for n, k, v in (("a", 1, 11.0), ("b", 1, 13.0), ("c", 100, 1000.0))
    ]
    strategy.aggregate(server_round=1, results=results, failures=[])
    assert strategy.global_state["w"].tolist() == [
        13.0
    ]  # 10 + median(1, 3, 990); the weight 100 buys nothing


def test_diloco_one_round_hand_computed_and_config():
    strategy = DiLoCo(inner_steps=50)
    strategy.initialize(initial_state=OrderedDict(w=torch.tensor([0.0], dtype=torch.float64)))
    ((client, ins),) = strategy.configure_round(server_round=1, clients=clients(1))
    assert ins.config["algorithm"] == "diloco" and ins.config["inner_steps"] == 50 and ins.expected is None
    strategy.aggregate(
        server_round=1, results=[_res("a", 1, w=torch.tensor([1.0], dtype=torch.float64))], failures=[]
    )
    # g = -1; b = -1; Nesterov d = g + 0.9 b = -1.9; x = 0 + 0.7 * 1.9
    torch.testing.assert_close(
        strategy.global_state["w"], torch.tensor([1.33], dtype=torch.float64), rtol=1e-12, atol=1e-12
    )


def test_fedprox_sends_mu_and_averages_like_fedavg():
    strategy = FedProx(sampling=Sampling(fit_config={"lr": 0.5}), proximal_mu=0.1)
    strategy.initialize(initial_state=model_state())
    pairs = strategy.configure_round(server_round=2, clients=clients(2))
    assert pairs[0][1].config == {
        "lr": 0.5,
        "round": 2,
        "seed": 0,
        "algorithm": "fedprox",
        "proximal_mu": 0.1,
    }
    fedavg = FedAvg()
    fedavg.initialize(initial_state=model_state())
    run_round(strategy, 1, clients(3))
    run_round(fedavg, 1, clients(3))
    for name, t in fedavg.global_state.items():
        assert torch.equal(strategy.global_state[name], t)
    with pytest.raises(ValueError, match="proximal_mu"):
        FedProx(proximal_mu=-1.0)


def test_scaffold_downlink_expected_and_update_hand_computed():
    strategy = Scaffold(server_lr=0.5)
    init = OrderedDict(w=torch.tensor([1.0, 2.0]), n=torch.tensor(0))
    strategy.initialize(initial_state=init)
    down = strategy.downlink_state(server_round=1)
    assert list(down) == ["w", "n", CONTROL_PREFIX + "w"] and down[CONTROL_PREFIX + "w"].tolist() == [
        0.0,
        0.0,
    ]
    live = clients(4)
    pairs = strategy.configure_round(server_round=1, clients=live)
    ins = pairs[0][1]
    assert ins.config["algorithm"] == "scaffold"
    assert ins.expected == OrderedDict(
        [
            ("w", TensorSpec(torch.float32, (2,))),
            ("n", TensorSpec(torch.int64, ())),
            (CONTROL_DELTA_PREFIX + "w", TensorSpec(torch.float32, (2,))),
        ]
    )
    results = [
        _res(
            "c00",
            1,
            w=torch.tensor([2.0, 2.0]),
            n=torch.tensor(2),
            **{CONTROL_DELTA_PREFIX + "w": torch.tensor([1.0, 0.0])},
        ),
        _res(
            "c01",
            3,
            w=torch.tensor([1.0, 6.0]),
            n=torch.tensor(2),
            **{CONTROL_DELTA_PREFIX + "w": torch.tensor([3.0, -4.0])},
        ),
    ]
    strategy.aggregate(
        server_round=1, results=results, failures=[Failure(live[2], "x"), Failure(live[3], "y")]
    )
    # model: weighted mean delta [(1*1 + 3*0)/4, (0 + 3*4)/4] = [0.25, 3]; x + 0.5 * that
    assert strategy.global_state["w"].tolist() == [1.125, 3.5]
    # c: 0 + (|S| / N) * unweighted mean(c_delta) = 2/4 * [2, -2]
    assert strategy.control_variate["w"].tolist() == [1.0, -1.0]
    assert strategy.downlink_state(server_round=2)[CONTROL_PREFIX + "w"].tolist() == [1.0, -1.0]
    assert strategy.global_state["n"].item() == 2


def test_scaffold_rejects_result_without_control_delta():
    strategy = Scaffold()
    strategy.initialize(initial_state=OrderedDict(w=torch.zeros(2)))
    with pytest.raises(ValueError, match="scaffold.c_delta.w"):
        strategy.aggregate(server_round=1, results=[_res("a", 1, w=torch.ones(2))], failures=[])


def test_scaffold_with_fake_clients_uses_total_clients():
    strategy = Scaffold(total_clients=10)
    strategy.initialize(initial_state=model_state())
    live = clients(4)
    pairs = strategy.configure_round(server_round=1, clients=live)
    sent = strategy.downlink_state(server_round=1)
    results = [fake_fit(c, ins, sent) for c, ins in pairs]
    strategy.aggregate(server_round=1, results=results, failures=[])
    name = "enc.weight"
    mean = torch.stack([r.state[CONTROL_DELTA_PREFIX + name] for r in results]).mean(dim=0)
    torch.testing.assert_close(strategy.control_variate[name], 0.4 * mean)
    assert set(strategy.control_variate) == {
        "enc.weight",
        "enc.bias",
        "bn.running_mean",
        "head.weight",
        "head.bias",
    }
    assert strategy.control_variate["bn.running_mean"].dtype == torch.float64


def test_median_under_scaffold_and_fedavgm():
    for strategy in (Scaffold(aggregator=Median()), FedAvgM(aggregator=Median())):
        strategy.initialize(initial_state=model_state())
        run_round(strategy, 1, clients(5))
        assert strategy.global_state["enc.weight"].shape == (4, 3)


def test_no_results_changes_nothing():
    for strategy in (FedAdam(), Scaffold(), DiLoCo()):
        strategy.initialize(initial_state=model_state())
        assert (
            strategy.aggregate(server_round=1, results=[], failures=[Failure(ClientInfo("x"), "gone")]) == {}
        )
        for name, t in model_state().items():
            assert torch.equal(strategy.global_state[name], t)


def test_configure_round_default_tasks_expect_the_model():
    strategy = FedAdam(sampling=Sampling(fit_config={"local_epochs": 1}))
    strategy.initialize(initial_state=model_state())
    for _, ins in strategy.configure_round(server_round=1, clients=clients(2)):
        assert ins == FitIns(round=1, config={"local_epochs": 1, "round": 1, "seed": 0})
