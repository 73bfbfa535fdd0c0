"""Unit tests of ``fedgrid.aggregation.fedavg``: the weighted mean and the FedAvg strategy."""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import replace

import pytest
import torch

from fedgrid.aggregation import FedAdam, FedAvg, WeightedMean, weighted_mean
from fedgrid.aggregation.selection import Sampling
from fedgrid.types import ClientInfo, Failure, FitIns, FitRes


def _od(**tensors: torch.Tensor) -> "OrderedDict[str, torch.Tensor]":
    return OrderedDict(tensors)


# -- weighted mean -------------------------------------------------------------------------
def test_weighted_mean_hand_computed():
    out = weighted_mean(
        [_od(w=torch.tensor([1.0, 2.0])), _od(w=torch.tensor([3.0, 6.0]))],
        [1, 3],
    )
    assert list(out) == ["w"]
    assert out["w"].dtype == torch.float32
    assert torch.equal(out["w"], torch.tensor([2.5, 5.0]))


def test_weighted_mean_several_tensors_hand_computed():
    updates = [
        _od(a=torch.tensor([[0.0, 10.0]]), b=torch.tensor(4.0, dtype=torch.float64)),
        _od(a=torch.tensor([[6.0, -2.0]]), b=torch.tensor(-2.0, dtype=torch.float64)),
        _od(a=torch.tensor([[3.0, 1.0]]), b=torch.tensor(1.0, dtype=torch.float64)),
    ]
    out = weighted_mean(updates, [2.0, 1.0, 1.0])
    # a: (2*[0,10] + [6,-2] + [3,1]) / 4 = [9/4, 19/4]; b: (8 - 2 + 1) / 4 = 7/4
    torch.testing.assert_close(out["a"], torch.tensor([[2.25, 4.75]]), rtol=0, atol=0)
    assert out["b"].dtype == torch.float64 and out["b"].shape == ()
    assert out["b"].item() == 1.75


def test_weighted_mean_one_client_is_identity():
    t = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    out = weighted_mean([_od(w=t)], [17.0])
    assert torch.equal(out["w"], t)


def test_weighted_mean_integer_tensors_round_to_nearest():
    out = weighted_mean(
        [
            _od(n=torch.tensor([1, 10, 0], dtype=torch.int64)),
            _od(n=torch.tensor([2, 0, 7], dtype=torch.int64)),
        ],
        [1.0, 2.0],
    )
    # exact means [5/3, 10/3, 14/3] = [1.67, 3.33, 4.67]
    assert out["n"].dtype == torch.int64
    assert out["n"].tolist() == [2, 3, 5]


def test_weighted_mean_int32_and_bool():
    out = weighted_mean(
        [
            _od(i=torch.tensor([-3], dtype=torch.int32), m=torch.tensor([True, False])),
            _od(i=torch.tensor([4], dtype=torch.int32), m=torch.tensor([True, True])),
        ],
        [3.0, 1.0],
    )
    # i: (-9 + 4) / 4 = -1.25 -> -1; m: [1, 0.25] -> [True, False]
    assert out["i"].dtype == torch.int32 and out["i"].tolist() == [-1]
    assert out["m"].dtype == torch.bool and out["m"].tolist() == [True, False]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_weighted_mean_preserves_low_precision_dtype(dtype):
    out = weighted_mean(
        [_od(w=torch.tensor([1.0, 2.0], dtype=dtype)), _od(w=torch.tensor([3.0, 6.0], dtype=dtype))],
        [1, 3],
    )
    assert out["w"].dtype == dtype
    assert out["w"].tolist() == [2.5, 5.0]


def test_weighted_mean_low_precision_accumulates_in_float64():
    # 1000 bf16 updates of 1 + 2^-7: float64 accumulation gives back exactly that value
    # (accumulating in bfloat16 itself would stall near 512 and return 0.51).
    value = 1.0 + 2.0**-7
    agg = WeightedMean()
    for _ in range(1000):
        agg.add(_od(w=torch.full((4,), value, dtype=torch.bfloat16)), 1.0)
    out = agg.result()
    assert out["w"].dtype == torch.bfloat16
    assert out["w"].tolist() == [value] * 4


def test_weighted_mean_complex():
    out = weighted_mean([_od(z=torch.tensor([1 + 2j])), _od(z=torch.tensor([3 - 2j]))], [1, 1])
    assert out["z"].dtype == torch.complex64
    assert out["z"].tolist() == [2 + 0j]


@pytest.mark.parametrize("weight", [0, 0.0, -1.0, math.inf, -math.inf, math.nan])
def test_bad_weight_raises(weight):
    agg = WeightedMean()
    with pytest.raises(ValueError, match="weight must be positive and finite"):
        agg.add(_od(w=torch.ones(2)), weight)


def test_mismatched_names_raise():
    agg = WeightedMean()
    agg.add(_od(w=torch.ones(2), b=torch.ones(1)), 1.0)
    with pytest.raises(ValueError, match="different tensors"):
        agg.add(_od(w=torch.ones(2)), 1.0)
    with pytest.raises(ValueError, match="different tensors"):
        agg.add(_od(w=torch.ones(2), c=torch.ones(1)), 1.0)
    with pytest.raises(ValueError, match="different tensors"):
        agg.add(_od(w=torch.ones(2), b=torch.ones(1), extra=torch.ones(1)), 1.0)


def test_mismatched_shapes_raise_naming_tensor():
    agg = WeightedMean()
    agg.add(_od(w=torch.ones(2, 3)), 1.0)
    with pytest.raises(ValueError, match=r"tensor 'w': shape \[3, 2\] differs from \[2, 3\]"):
        agg.add(_od(w=torch.ones(3, 2)), 1.0)


def test_mismatched_update_and_weight_counts_raise():
    with pytest.raises(ValueError):
        weighted_mean([_od(w=torch.ones(1)), _od(w=torch.ones(1))], [1.0])


def test_result_before_add_raises_and_reset_forgets():
    agg = WeightedMean()
    with pytest.raises(ValueError, match="no update was added"):
        agg.result()
    agg.add(_od(w=torch.tensor([100.0])), 5.0)
    agg.reset()
    with pytest.raises(ValueError, match="no update was added"):
        agg.result()
    agg.add(_od(v=torch.tensor([1.0, 3.0])), 2.0)  # different names after reset are fine
    assert agg.result()["v"].tolist() == [1.0, 3.0]


def test_weighted_mean_does_not_modify_inputs():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])
    weighted_mean([_od(w=a), _od(w=b)], [1, 3])
    assert a.tolist() == [1.0, 2.0] and b.tolist() == [3.0, 6.0]


def test_weighted_mean_independent_of_order():
    gen = torch.Generator().manual_seed(0)
    updates = [
        _od(w=torch.randn(1000, generator=gen) * 10 ** (i % 3), b=torch.randn(7, generator=gen))
        for i in range(5)
    ]
    weights = [1.0, 7.0, 3.0, 250.0, 11.0]
    reference = weighted_mean(updates, weights)
    expected = sum(u["w"].double() * w for u, w in zip(updates, weights)) / sum(weights)
    torch.testing.assert_close(reference["w"].double(), expected, rtol=1e-7, atol=1e-7)
    # Another order may differ in the last bits of float64 (exact reproducibility comes from
    # folding in a canonical order, see FedAvg.aggregate).
    for perm in itertools.islice(itertools.permutations(range(5)), 1, None, 7):
        out = weighted_mean([updates[i] for i in perm], [weights[i] for i in perm])
        for name in reference:
            torch.testing.assert_close(out[name], reference[name], rtol=1e-7, atol=1e-7)


# -- FedAvg strategy -----------------------------------------------------------------------
def _clients(n: int) -> list[ClientInfo]:
    # ids deliberately out of step with names: the order must follow sort_key (name first)
    return [
        ClientInfo(client_id=f"id-{(7 * i) % n:02d}", name=f"client-{i:02d}", num_examples=10 + i)
        for i in range(n)
    ]


def test_configure_round_all_clients_sorted_by_sort_key():
    clients = _clients(6)
    shuffled = [clients[i] for i in (3, 0, 5, 1, 4, 2)]
    strategy = FedAvg(sampling=Sampling(seed=3, fit_config={"lr": 0.1, "local_epochs": 2}))
    pairs = strategy.configure_round(server_round=4, clients=shuffled)
    assert [c for c, _ in pairs] == clients
    for _, ins in pairs:
        assert ins == FitIns(round=4, config={"lr": 0.1, "local_epochs": 2, "round": 4, "seed": 3})


def test_configure_round_sort_key_breaks_name_ties_by_id():
    a = ClientInfo(client_id="b", name="same")
    b = ClientInfo(client_id="a", name="same")
    c = ClientInfo(client_id="z", name="")
    pairs = FedAvg().configure_round(server_round=1, clients=[a, b, c])
    assert [x.client_id for x, _ in pairs] == ["z", "a", "b"]


def test_configure_round_fraction_samples_reproducibly():
    clients = _clients(10)
    strategy = FedAvg(sampling=Sampling(fraction_fit=0.5, seed=11))
    picks = {}
    for server_round in range(1, 6):
        chosen = [c for c, _ in strategy.configure_round(server_round=server_round, clients=clients)]
        assert len(chosen) == 5
        assert len({c.client_id for c in chosen}) == 5
        assert chosen == sorted(chosen, key=lambda c: c.sort_key)
        assert set(chosen) <= set(clients)
        again = FedAvg(sampling=Sampling(fraction_fit=0.5, seed=11)).configure_round(
            server_round=server_round, clients=list(reversed(clients))
        )
        assert [c for c, _ in again] == chosen
        picks[server_round] = tuple(c.client_id for c in chosen)
    assert len(set(picks.values())) > 1  # rounds draw different subsets


def test_configure_round_seed_changes_sample():
    clients = _clients(10)
    draws = {
        tuple(
            c.client_id
            for c, _ in FedAvg(sampling=Sampling(fraction_fit=0.5, seed=seed)).configure_round(
                server_round=1, clients=clients
            )
        )
        for seed in range(5)
    }
    assert len(draws) > 1


@pytest.mark.parametrize(
    "fraction,min_fit,n,count",
    [
        (0.1, 1, 10, 1),
        (0.01, 1, 10, 1),
        (0.3, 1, 10, 3),
        (0.1, 4, 10, 4),
        (0.5, 20, 10, 10),
        (1.0, 1, 3, 3),
        (0.5, 1, 0, 0),
    ],
)
def test_configure_round_count(fraction, min_fit, n, count):
    pairs = FedAvg(sampling=Sampling(fraction_fit=fraction, min_fit_clients=min_fit)).configure_round(
        server_round=1, clients=_clients(n) if n else []
    )
    assert len(pairs) == count


@pytest.mark.parametrize(
    "kwargs", [{"fraction_fit": 0.0}, {"fraction_fit": 1.5}, {"fraction_fit": -0.1}, {"min_fit_clients": 0}]
)
def test_fedavg_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        FedAvg(sampling=Sampling(**kwargs))


def test_the_sampling_keywords_of_before_sampling_are_refused():
    with pytest.raises(TypeError, match="unexpected keyword argument 'fraction_fit'"):
        FedAdam(fraction_fit=0.5, server_lr=0.1)


def test_global_state_before_initialize_raises():
    with pytest.raises(RuntimeError, match="initialize"):
        FedAvg().global_state


def test_initialize_copies_state():
    init = _od(w=torch.zeros(2))
    strategy = FedAvg()
    strategy.initialize(initial_state=init)
    init["w"].add_(1.0)
    assert strategy.global_state["w"].tolist() == [0.0, 0.0]


def test_aggregate_weighted_mean_and_train_loss():
    clients = _clients(3)
    strategy = FedAvg()
    strategy.initialize(initial_state=_od(w=torch.zeros(2), n=torch.tensor(0)))
    results = [
        FitRes(
            clients[2],
            _od(w=torch.tensor([3.0, 6.0]), n=torch.tensor(4)),
            num_examples=30,
            metrics={"loss": 0.5},
        ),
        FitRes(
            clients[0],
            _od(w=torch.tensor([1.0, 2.0]), n=torch.tensor(2)),
            num_examples=10,
            metrics={"loss": 2.0},
        ),
        FitRes(clients[1], _od(w=torch.tensor([0.0, 0.0]), n=torch.tensor(0)), num_examples=60, metrics={}),
    ]
    failures = [Failure(ClientInfo(client_id="gone"), "timeout")]
    metrics = strategy.aggregate(server_round=1, results=results, failures=failures)
    # w: (10*[1,2] + 30*[3,6] + 60*0) / 100 = [1.0, 2.0]; n: (20 + 120) / 100 = 1.4 -> 1
    assert strategy.global_state["w"].tolist() == [1.0, 2.0]
    assert strategy.global_state["n"].item() == 1 and strategy.global_state["n"].dtype == torch.int64
    # loss: clients without a loss are left out: (10*2.0 + 30*0.5) / 40
    assert metrics == {"train_loss": pytest.approx(35.0 / 40.0, rel=1e-12)}


def test_aggregate_without_results_keeps_state():
    strategy = FedAvg()
    strategy.initialize(initial_state=_od(w=torch.tensor([4.0])))
    assert (
        strategy.aggregate(server_round=1, results=[], failures=[Failure(ClientInfo(client_id="x"), "crash")])
        == {}
    )
    assert strategy.global_state["w"].tolist() == [4.0]


def test_aggregate_independent_of_result_order():
    clients = _clients(4)
    gen = torch.Generator().manual_seed(1)
    results = [
        FitRes(
            c, _od(w=torch.randn(100, generator=gen)), num_examples=c.num_examples, metrics={"loss": float(i)}
        )
        for i, c in enumerate(clients)
    ]
    outs = []
    for perm in [(0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2)]:
        strategy = FedAvg()
        strategy.initialize(initial_state=_od(w=torch.zeros(100)))
        outs.append(
            (
                strategy.aggregate(server_round=1, results=[results[i] for i in perm], failures=[]),
                strategy.global_state["w"],
            )
        )
    for metrics, w in outs[1:]:
        assert metrics == outs[0][0]
        assert torch.equal(w, outs[0][1])  # canonical order makes it bit-identical


def test_state_dict_roundtrip():
    strategy = FedAvg(sampling=Sampling(seed=42))
    strategy.initialize(initial_state=_od(w=torch.tensor([1.0, 2.0]), b=torch.tensor([3], dtype=torch.int64)))
    state = strategy.state_dict()
    assert state["seed"] == 42
    strategy.global_state["w"].add_(100.0)  # state_dict is a copy
    assert state["global_state"]["w"].tolist() == [1.0, 2.0]

    restored = FedAvg(sampling=Sampling(seed=0))
    restored.load_state_dict(state)
    assert restored.seed == 42
    assert list(restored.global_state) == ["w", "b"]
    assert restored.global_state["w"].tolist() == [1.0, 2.0]
    assert restored.global_state["b"].dtype == torch.int64 and restored.global_state["b"].tolist() == [3]
    clients = _clients(10)
    a = FedAvg(sampling=Sampling(fraction_fit=0.5, seed=42)).configure_round(server_round=3, clients=clients)
    restored.sampling = replace(restored.sampling, fraction_fit=0.5)
    assert restored.configure_round(server_round=3, clients=clients) == a


def test_weighted_mean_of_copies_is_exact():
    gen = torch.Generator().manual_seed(3)
    x = _od(w=torch.randn(4096, generator=gen), h=torch.randn(64, generator=gen).to(torch.bfloat16))
    for n in (10, 500):
        out = weighted_mean([x] * n, [float(i % 7 + 1) for i in range(n)])
        assert torch.equal(out["w"], x["w"]) and torch.equal(out["h"], x["h"])
