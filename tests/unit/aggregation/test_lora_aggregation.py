"""The LoRA aggregation rules on hand-made factors (``fedgrid.aggregation.lora``, ``lora_aggregation``):
each equals its formula, and the SVD rule is exact when the rank suffices."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from fedgrid.aggregation.by_name import build_strategy_from
from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.lora import lora_pairs, product_mean, svd_average, svd_merge
from fedgrid.aggregation.lora_ranks import state_at_rank
from fedgrid.errors import ConfigError
from fedgrid.types import ClientInfo, FitRes

A, B = "layer.q_proj.lora_A.default.weight", "layer.q_proj.lora_B.default.weight"
OUT, IN = 6, 5


def _factors(seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rank, IN, generator=g), torch.randn(OUT, rank, generator=g)


def _results(factors, examples, *, delta_from=None) -> list[FitRes]:
    out = []
    for i, ((a, b), n) in enumerate(zip(factors, examples)):
        state = OrderedDict([(A, a), (B, b)])
        if delta_from is not None:
            state = OrderedDict((k, v - delta_from[k]) for k, v in state.items())
        out.append(FitRes(ClientInfo(f"c{i}", name=f"c{i}"), state, n, delta=delta_from is not None))
    return out


def _strategy(rule: str, rank: int) -> FedAvg:
    strategy = FedAvg(lora_aggregation=rule)
    strategy.initialize(initial_state=OrderedDict([(A, torch.zeros(rank, IN)), (B, torch.zeros(OUT, rank))]))
    return strategy


def test_factors_average_a_and_b_each_which_is_not_the_mean_of_the_products():
    factors, examples = [_factors(1, 2), _factors(2, 2)], [10, 30]
    strategy = _strategy("factors", 2)
    strategy.aggregate(server_round=1, results=_results(factors, examples), failures=[])
    got = strategy.global_state
    w = torch.tensor([0.25, 0.75])
    torch.testing.assert_close(got[A], w[0] * factors[0][0] + w[1] * factors[1][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(got[B], w[0] * factors[0][1] + w[1] * factors[1][1], rtol=0, atol=1e-6)
    products = sum(wi * b @ a for wi, (a, b) in zip(w, factors))
    assert (got[B] @ got[A] - products).abs().max() > 0.1  # the cross terms B_i A_j


@pytest.mark.parametrize("delta", [False, True])
def test_svd_is_the_mean_of_the_products_exactly_when_the_rank_suffices(delta):
    # Rank-4 factors (the global shape) of effective rank 2 each: 2 + 2 <= 4.
    factors = [
        (torch.cat([a, torch.zeros(2, IN)]), torch.cat([b, torch.zeros(OUT, 2)], 1))
        for a, b in (_factors(1, 2), _factors(2, 2))
    ]
    examples = [10, 30]
    strategy = _strategy("svd", 4)
    start = OrderedDict((k, v.clone()) for k, v in strategy.global_state.items())
    results = _results(factors, examples, delta_from=start if delta else None)
    strategy.aggregate(server_round=1, results=results, failures=[])
    got = strategy.global_state
    products = 0.25 * factors[0][1] @ factors[0][0] + 0.75 * factors[1][1] @ factors[1][0]
    assert got[A].shape == (4, IN) and got[B].shape == (OUT, 4)
    torch.testing.assert_close(got[B] @ got[A], products, rtol=0, atol=1e-5)


def test_svd_truncates_to_the_best_rank_r_approximation():
    factors, examples = [_factors(1, 2), _factors(2, 2), _factors(3, 2)], [1, 1, 2]
    strategy = _strategy("svd", 2)
    strategy.aggregate(server_round=1, results=_results(factors, examples), failures=[])
    mean = sum(w * b.double() @ a.double() for w, (a, b) in zip([0.25, 0.25, 0.5], factors))
    u, s, vh = torch.linalg.svd(mean)
    best = (u[:, :2] * s[:2]) @ vh[:2]  # Eckart-Young
    got = strategy.global_state
    torch.testing.assert_close((got[B] @ got[A]).double(), best, rtol=0, atol=1e-5)


def test_svd_merges_clients_of_different_ranks_and_scales():
    factors = [_factors(1, 1), _factors(2, 3)]
    scales = [16 / 1, 16 / 3]  # alpha = 16 at ranks 1 and 3
    a, b = svd_merge(factors, [1.0, 1.0], rank=4, scale=16 / 4, scales=scales)
    expected = 0.5 * (scales[0] * factors[0][1] @ factors[0][0] + scales[1] * factors[1][1] @ factors[1][0])
    torch.testing.assert_close(16 / 4 * b @ a, expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(product_mean(factors, [1.0, 1.0], scales).float(), expected, rtol=0, atol=1e-4)
    # A rank above the product's own (4 > 1 + 3 is not needed: rank 4 of a 6x5 product of rank 4).
    assert a.shape == (4, IN) and b.shape == (OUT, 4)


def test_ffa_averages_b_over_a_shared_a_which_is_the_mean_of_the_products():
    shared_a = _factors(7, 2)[0]
    bs = [_factors(1, 2)[1], _factors(2, 2)[1]]
    strategy = _strategy("ffa", 2)
    strategy.initialize(initial_state=OrderedDict([(B, torch.zeros(OUT, 2))]))  # FFA sends B only
    results = [
        FitRes(ClientInfo(f"c{i}", name=f"c{i}"), OrderedDict([(B, b)]), n)
        for i, (b, n) in enumerate(zip(bs, [10, 30]))
    ]
    strategy.aggregate(server_round=1, results=results, failures=[])
    torch.testing.assert_close(
        strategy.global_state[B] @ shared_a,
        0.25 * bs[0] @ shared_a + 0.75 * bs[1] @ shared_a,
        rtol=0,
        atol=1e-5,
    )


def test_pairs_are_found_by_name_and_a_lone_factor_is_an_error():
    assert lora_pairs([A, B, "other.weight"]) == OrderedDict([(A, B)])
    with pytest.raises(ValueError, match="has no"):
        lora_pairs([A])
    with pytest.raises(ValueError, match="has no"):
        lora_pairs([B])


def test_the_rule_is_chosen_per_run_and_checked():
    assert build_strategy_from("fedavg", lora_aggregation="svd").lora_aggregation == "svd"  # type: ignore[attr-defined]
    assert build_strategy_from("fedprox", lora_aggregation="svd").lora_aggregation == "svd"  # type: ignore[attr-defined]
    assert build_strategy_from("diloco", lora_aggregation="ffa") is not None  # the plain mean: every strategy
    with pytest.raises(ConfigError, match="does not apply to strategy 'diloco'"):
        build_strategy_from("diloco", lora_aggregation="svd")
    with pytest.raises(ValueError, match="lora_aggregation must be one of"):
        FedAvg(lora_aggregation="mean-of-products")


def test_svd_takes_a_delta_at_its_own_rank_from_the_pair_at_that_rank():
    # A global pair of rank 4 and two clients, of ranks 2 and 4: each difference is from the
    # pair it downloaded (state_at_rank for rank 2). The merge of the differences is the merge
    # of the values they stand for, and a difference of another rank needs the model at it.
    strategy = _strategy("svd", 4)
    a0, b0 = _factors(7, 4)
    strategy.global_state[A], strategy.global_state[B] = a0, b0
    start = OrderedDict((k, v.clone()) for k, v in strategy.global_state.items())
    down = [state_at_rank(start, 2), start]
    factors, examples = [_factors(1, 2), _factors(2, 4)], [10, 30]
    deltas = [
        FitRes(ClientInfo(f"c{i}"), OrderedDict([(A, a - d[A]), (B, b - d[B])]), n, delta=True)
        for i, ((a, b), d, n) in enumerate(zip(factors, down, examples))
    ]
    expected = svd_average(start, _results(factors, examples), [A, B])
    strategy.aggregate(server_round=1, results=deltas, failures=[])
    got = strategy.global_state
    assert got[A].shape == (4, IN) and got[B].shape == (OUT, 4)
    torch.testing.assert_close(got[B] @ got[A], expected[B] @ expected[A], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="rank 2: no model at that rank"):
        svd_average(start, deltas, [A, B])
