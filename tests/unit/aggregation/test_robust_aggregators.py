"""Unit tests of the robust aggregators (``robust``, ``clipping``) and ``build_aggregator``."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import pytest
import torch

from fedgrid.aggregation import (
    AggregationPreconditionError,
    Aggregator,
    CenteredClip,
    FedAvg,
    Krum,
    Mean,
    Median,
    MultiKrum,
    NormClip,
    TrimmedMean,
    build_aggregator,
)
from fedgrid.errors import ConfigError
from fedgrid.types import ClientInfo, FitRes


def _agg(
    rule: Aggregator, values: Sequence[Sequence[float] | float], weights: Sequence[float] | None = None
) -> list[float]:
    """Aggregates one tensor ``w`` per update; returns the result as a list."""
    rule.reset()
    for i, v in enumerate(values):
        t = (
            torch.tensor(v, dtype=torch.float64)
            if isinstance(v, (int, float))
            else torch.tensor(list(v), dtype=torch.float64)
        )
        rule.add(OrderedDict(w=t.reshape(-1)), 1.0 if weights is None else weights[i])
    return rule.result()["w"].tolist()


# -- median --------------------------------------------------------------------------------
def test_median_odd_even_and_coordinatewise():
    assert _agg(Median(), [1.0, 5.0, 3.0]) == [3.0]
    assert _agg(Median(), [1.0, 5.0, 3.0, 10.0]) == [4.0]  # mean of the two middle values
    assert _agg(Median(), [[1, 30], [2, 10], [3, 20]]) == [2.0, 20.0]


def test_median_ties_and_one_client():
    assert _agg(Median(), [2.0, 2.0, 7.0]) == [2.0]
    assert _agg(Median(), [7.0, 2.0, 2.0, 7.0]) == [4.5]
    assert _agg(Median(), [[1.5, -2.0]]) == [1.5, -2.0]


def test_median_ignores_weights_unless_asked():
    assert _agg(Median(), [1.0, 2.0, 10.0], [1, 1, 5]) == [2.0]
    # weighted: cumulative [1, 2, 7] first reaches 3.5 at 10
    assert _agg(Median(weighted=True), [1.0, 2.0, 10.0], [1, 1, 5]) == [10.0]
    # cumulative [3, 4, 6, 8] hits exactly half (4) at 2: mean of 2 and 3
    assert _agg(Median(weighted=True), [1.0, 2.0, 3.0, 4.0], [3, 1, 2, 2]) == [2.5]


def test_median_keeps_dtype_and_rounds_integers():
    rule = Median()
    for v in ([1, 2], [2, 2], [4, 9], [5, 9]):
        rule.add(
            OrderedDict(w=torch.tensor(v, dtype=torch.float32), n=torch.tensor(v, dtype=torch.int64)), 1.0
        )
    out = rule.result()
    assert out["w"].dtype == torch.float32 and out["w"].tolist() == [3.0, 5.5]
    assert out["n"].dtype == torch.int64 and out["n"].tolist() == [3, 6]  # 5.5 rounds half to even


# -- trimmed mean --------------------------------------------------------------------------
def test_trimmed_mean_hand_computed():
    assert _agg(TrimmedMean(beta=0.2), [1.0, 2.0, 3.0, 4.0, 100.0]) == [3.0]
    assert _agg(TrimmedMean(beta=0.25), [100.0, 2.0, 3.0, 1.0]) == [2.5]
    assert _agg(TrimmedMean(beta=0.0), [1.0, 2.0, 9.0]) == [4.0]  # beta 0 is the mean
    assert _agg(TrimmedMean(beta=0.3), [1.0, 2.0, 3.0, 4.0, 100.0]) == [3.0]  # floor(1.5) = 1 each side


def test_trimmed_mean_weighted():
    # equal weights and integer beta * n: same as unweighted
    assert _agg(TrimmedMean(beta=0.25, weighted=True), [1.0, 2.0, 3.0, 4.0], [5, 5, 5, 5]) == [2.5]
    # W = 4, keep weight in [1, 3]: half of 0's weight 2, all of 10's, none of 20's -> (0 + 10) / 2
    assert _agg(TrimmedMean(beta=0.25, weighted=True), [0.0, 10.0, 20.0], [2, 1, 1]) == [5.0]


def test_trimmed_mean_one_client_with_beta_zero():
    assert _agg(TrimmedMean(beta=0.0), [[4.0, -1.0]]) == [4.0, -1.0]


def test_trimmed_mean_preconditions():
    with pytest.raises(ConfigError, match="trims nothing from 5 updates.*at least 10 updates"):
        TrimmedMean(beta=0.1).check_preconditions(num_clients=5)
    TrimmedMean(beta=0.1).check_preconditions(num_clients=10)
    with pytest.raises(AggregationPreconditionError, match="trims nothing"):
        _agg(TrimmedMean(beta=0.2), [1.0, 2.0, 3.0, 4.0])
    for beta in (-0.1, 0.5, 0.7):
        with pytest.raises(ValueError, match=r"beta must be in \[0, 0.5\)"):
            TrimmedMean(beta=beta)


# -- Krum ----------------------------------------------------------------------------------
def test_krum_hand_computed_and_ties():
    # n = 5, f = 1: 2 neighbours. Squared-distance scores: 0 -> 1+4, 1 -> 1+1, 2 -> 1+1, 3 -> 1+4,
    # 100 -> 97^2+98^2. 1 and 2 tie: the first added wins.
    assert _agg(Krum(f=1), [0.0, 1.0, 2.0, 100.0, 3.0]) == [1.0]
    assert _agg(Krum(f=1), [0.0, 2.0, 1.0, 100.0, 3.0]) == [2.0]
    assert _agg(Krum(f=1), [0.0, 1.0, 2.0, 100.0, 3.0], [1, 1, 1, 1e9, 1]) == [1.0]  # weights never select


def test_krum_scores_use_all_tensors():
    rule = Krum(f=0)
    for a, b in ([0.0, 0.0], [1.0, 0.0], [0.0, 3.0]):
        rule.add(OrderedDict(a=torch.tensor([a]), b=torch.tensor([b])), 1.0)
    # 1 neighbour each: d(0,1) = 1, d(0,2) = 9, d(1,2) = 10 -> scores 1, 1, 9
    assert rule.scores().tolist() == [1.0, 1.0, 9.0]
    out = rule.result()
    assert out["a"].tolist() == [0.0] and out["b"].tolist() == [0.0]


def test_krum_f_at_its_bound():
    values = [0.0, 1.0, 2.0, 3.0, 50.0, -50.0, 4.0]  # n = 7 = 2f + 3 for f = 2
    Krum(f=2).check_preconditions(num_clients=7)
    assert _agg(Krum(f=2), values) in ([1.0], [2.0], [3.0])
    with pytest.raises(
        ConfigError, match=r"config key 'aggregator': krum: needs more than 2f \+ 2 = 6 updates"
    ):
        Krum(f=2).check_preconditions(num_clients=6)
    with pytest.raises(AggregationPreconditionError, match="needs more than 2f"):
        _agg(Krum(f=2), values[:6])


def test_krum_one_client_fails_precondition():
    with pytest.raises(AggregationPreconditionError):
        _agg(Krum(f=0), [1.0])
    with pytest.raises(ConfigError):
        Krum(f=0).check_preconditions(num_clients=2)
    assert _agg(Krum(f=0), [1.0, 1.5, 9.0]) == [1.0]  # n = 3 = 2f + 3: 1 and 1.5 tie, the first wins
    assert _agg(Krum(f=0), [9.0, 1.5, 1.0]) == [1.5]


def test_multi_krum_hand_computed():
    values = [0.0, 1.0, 2.0, 100.0, 3.0]  # scores [5, 2, 2, huge, 5]
    assert _agg(MultiKrum(f=1, m=3), values) == [1.0]  # picks 1, 2, then 0 (first of the 5s)
    assert _agg(MultiKrum(f=1, m=3, weighted=True), values, [1, 1, 2, 1, 1]) == [1.25]  # (0 + 1 + 2*2) / 4
    assert _agg(MultiKrum(f=1), values) == [1.5]  # m = n - f = 4: mean of 0, 1, 2, 3
    assert _agg(MultiKrum(f=1, m=1), values) == _agg(Krum(f=1), values)
    with pytest.raises(AggregationPreconditionError, match="m=5 exceeds n - f = 4"):
        _agg(MultiKrum(f=1, m=5), values)


def test_krum_bad_arguments():
    for kwargs in ({"f": -1}, {"f": 1.5}, {"f": True}):
        with pytest.raises(ValueError, match="f must be"):
            Krum(**kwargs)
    with pytest.raises(ValueError, match="m must be"):
        MultiKrum(f=1, m=0)


# -- clipping ------------------------------------------------------------------------------
def test_norm_clip_hand_computed():
    # [3, 4] has norm 5 -> [0.6, 0.8]; [0.3, 0.4] has norm 0.5 and passes
    assert _agg(NormClip(bound=1.0), [[3.0, 4.0], [0.3, 0.4]]) == pytest.approx([0.45, 0.6], rel=1e-12)
    # weighted by default: (3 * [0.6, 0.8] + [0.3, 0.4]) / 4
    assert _agg(NormClip(bound=1.0), [[3.0, 4.0], [0.3, 0.4]], [3, 1]) == pytest.approx(
        [0.525, 0.7], rel=1e-12
    )
    assert _agg(NormClip(bound=1.0, weighted=False), [[3.0, 4.0], [0.3, 0.4]], [3, 1]) == pytest.approx(
        [0.45, 0.6], rel=1e-12
    )
    assert _agg(NormClip(bound=10.0), [[3.0, 4.0]]) == [3.0, 4.0]  # one short update passes unchanged


def test_norm_clip_without_a_bound_clips_to_the_rounds_median_norm():
    rule = NormClip()
    # norms 5, 0.5, 50: median 5; [30, 40] -> [3, 4]; the others pass
    assert _agg(rule, [[3.0, 4.0], [0.3, 0.4], [30.0, 40.0]]) == pytest.approx([6.3 / 3, 8.4 / 3], rel=1e-12)
    assert rule.last_bound == 5.0
    # even count: the mean of the two middle norms (0.5 and 5 -> 2.75), recomputed each round;
    # [3, 4] and [30, 40] both become [1.65, 2.2]
    assert _agg(rule, [[3.0, 4.0], [0.3, 0.4], [0.0, 0.0], [30.0, 40.0]]) == pytest.approx(
        [0.9, 1.2], rel=1e-12
    )
    assert rule.last_bound == 2.75
    # a minority of huge updates cannot raise the bound: 3 honest norms of 1, 2 attackers at 1e6
    honest, attack = [[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], [[1e6, 0.0], [0.0, 1e6]]
    assert _agg(rule, honest + attack) == pytest.approx([(1 + 0.6 + 1) / 5, (1 + 0.8 + 1) / 5], rel=1e-12)
    assert rule.last_bound == 1.0
    assert _agg(rule, [[0.0, 0.0], [0.0, 0.0]]) == [0.0, 0.0]  # all zero: median 0, nothing divided by it


def test_norm_clip_norm_spans_tensors_and_skips_integers():
    rule = NormClip(bound=2.5)
    rule.add(
        OrderedDict(a=torch.tensor([3.0]), b=torch.tensor([4.0]), n=torch.tensor([8])), 1.0
    )  # norm 5 -> half
    out = rule.result()
    assert out["a"].tolist() == [1.5] and out["b"].tolist() == [2.0] and out["n"].tolist() == [8]


def test_centered_clip_hand_computed():
    # v0 = 0; diffs 0, 0, 10; the third is clipped to 1 -> v = 1/3
    assert _agg(CenteredClip(tau=1.0, iterations=1), [0.0, 0.0, 10.0]) == pytest.approx([1 / 3], rel=1e-12)
    # second iteration: diffs -1/3, -1/3, 29/3 (clipped to 1) -> v = 1/3 + (1/3) / 3 = 4/9
    assert _agg(CenteredClip(tau=1.0, iterations=2), [0.0, 0.0, 10.0]) == pytest.approx([4 / 9], rel=1e-12)
    # weighted: 0 has weight 2, 10 weight 1 (clipped to 1) -> v = 1/3 as well; unweighted ignores them
    assert _agg(CenteredClip(tau=1.0, iterations=1, weighted=True), [0.0, 10.0], [2, 1]) == pytest.approx(
        [1 / 3], rel=1e-12
    )
    assert _agg(CenteredClip(tau=1.0, iterations=1), [0.0, 10.0], [2, 1]) == pytest.approx([0.5], rel=1e-12)
    # a large tau clips nothing: one iteration is the mean
    assert _agg(CenteredClip(tau=1e6, iterations=1), [1.0, 2.0, 6.0]) == [3.0]
    # one client: each iteration moves the center 0.5 (in L2 norm) toward it
    assert _agg(CenteredClip(tau=0.5, iterations=3), [[2.0, 2.0]]) == pytest.approx([1.5 / 2**0.5] * 2)


def test_centered_clip_bad_arguments():
    with pytest.raises(ValueError, match="tau"):
        CenteredClip(tau=0.0)
    with pytest.raises(ValueError, match="iterations"):
        CenteredClip(iterations=0)


# -- shared contract -----------------------------------------------------------------------
RULES = [
    lambda: Mean(),
    lambda: Median(),
    lambda: TrimmedMean(beta=0.0),
    lambda: Krum(f=0),
    lambda: MultiKrum(f=0),
    lambda: NormClip(bound=1.0),
    lambda: NormClip(),
    lambda: CenteredClip(),
]


@pytest.mark.parametrize("factory", RULES)
def test_contract_errors(factory):
    rule = factory()
    with pytest.raises(ValueError, match="no update was added"):
        rule.result()
    with pytest.raises(ValueError, match="weight must be positive and finite"):
        rule.add(OrderedDict(w=torch.ones(2)), 0.0)
    rule.add(OrderedDict(w=torch.ones(2)), 1.0)
    with pytest.raises(ValueError):
        rule.add(OrderedDict(v=torch.ones(2)), 1.0)
    with pytest.raises(ValueError):
        rule.add(OrderedDict(w=torch.ones(3)), 1.0)


@pytest.mark.parametrize("factory", RULES)
def test_identical_updates_give_that_update(factory):
    rule = factory()
    t = torch.tensor([0.25, -0.5, 0.125])
    for _ in range(3):
        rule.add(OrderedDict(w=t.clone()), 2.0)
    out = rule.result()
    assert out["w"].dtype == torch.float32
    torch.testing.assert_close(out["w"], t, rtol=0, atol=1e-7)
    rule.reset()
    with pytest.raises(ValueError, match="no update was added"):
        rule.result()


# -- build_aggregator ----------------------------------------------------------------------
def test_build_aggregator_names_and_params():
    assert isinstance(build_aggregator("mean"), Mean)
    rule = build_aggregator("trimmed-mean", beta=0.2, weighted=None)
    assert isinstance(rule, TrimmedMean) and rule.beta == 0.2 and not rule.weighted
    rule = build_aggregator("multi-krum", f=2, m=3)
    assert isinstance(rule, MultiKrum) and (rule.f, rule.m) == (2, 3)
    assert isinstance(build_aggregator("norm-clip", bound=3.0), NormClip)
    assert isinstance(build_aggregator("centered-clip", tau=2.0, iterations=2), CenteredClip)
    assert isinstance(build_aggregator("median", weighted=True), Median)
    assert isinstance(build_aggregator("krum", f=1), Krum)


@pytest.mark.parametrize(
    "name,params,message",
    [
        ("mode", {}, "unknown aggregator 'mode' \\(known: mean, median"),
        ("krum", {"beta": 0.1}, "krum takes no option 'beta' \\(its options: f, bucket_size, resamplings\\)"),
        ("trimmed-mean", {"beta": 0.5}, r"trimmed-mean: beta must be in \[0, 0.5\), got 0.5"),
        ("krum", {"f": -2}, "krum: f must be a non-negative integer"),
        ("norm-clip", {"bound": float("inf")}, "bound must be positive and finite, got inf"),
        ("norm-clip", {"bound": -1.0}, "bound must be positive"),
        ("centered-clip", {"iterations": 0}, "iterations must be a positive integer"),
    ],
)
def test_build_aggregator_errors(name, params, message):
    with pytest.raises(ConfigError, match=message) as info:
        build_aggregator(name, **params)
    assert info.value.key == "aggregator"


# -- under attack --------------------------------------------------------------------------
def _attacked(
    attack: str, n: int = 10, bad: int = 2, dim: int = 50
) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    direction = torch.ones(dim)
    honest = [direction + 0.1 * torch.randn(dim, generator=gen) for _ in range(n - bad)]
    if attack == "sign-flip":
        byzantine = [-h for h in honest[:bad]]
    else:
        byzantine = [100.0 * torch.randn(dim, generator=gen) for _ in range(bad)]
    return honest + byzantine, torch.stack(honest).mean(dim=0)


@pytest.mark.parametrize("attack", ["sign-flip", "gaussian"])
def test_robust_rules_resist_twenty_percent_attackers(attack):
    updates, honest_mean = _attacked(attack)

    def error(rule: Aggregator) -> float:
        for u in updates:
            rule.add(OrderedDict(w=u), 1.0)
        return float((rule.result()["w"] - honest_mean).norm() / honest_mean.norm())

    assert error(Mean()) > 0.3  # the attack works on the plain mean ...
    for rule in (
        Median(),
        TrimmedMean(beta=0.2),
        Krum(f=2),
        MultiKrum(f=2),
        CenteredClip(tau=1.0, iterations=30),
    ):
        assert error(rule) < 0.15, (
            rule.name
        )  # ... and not on the robust rules (one honest update is ~0.09 off)
    if attack == "gaussian":
        assert error(NormClip(bound=8.0)) < 0.5 < 10 < error(Mean())  # bounded influence, not robustness


def _result(i: int, delta: torch.Tensor) -> FitRes:
    client = ClientInfo(client_id=f"id{i}", name=f"c{i:02d}", num_examples=10)
    return FitRes(client, OrderedDict(w=delta.clone(), n=torch.tensor(i)), num_examples=10)


@pytest.mark.parametrize("attack", ["sign-flip", "gaussian"])
def test_fedavg_with_robust_aggregator_resists_attack(attack):
    updates, honest_mean = _attacked(attack)
    outcomes = {}
    for label, rule in (("mean", None), ("median", Median()), ("krum", Krum(f=2))):
        strategy = FedAvg(aggregator=rule)
        strategy.initialize(initial_state=OrderedDict(w=torch.zeros(50), n=torch.tensor(0)))
        strategy.aggregate(
            server_round=1, results=[_result(i, u) for i, u in enumerate(updates)], failures=[]
        )
        outcomes[label] = float((strategy.global_state["w"] - honest_mean).norm() / honest_mean.norm())
        assert (
            strategy.global_state["n"].item() == 4
        )  # integer buffers: weighted mean of the values, 4.5 -> 4
    assert outcomes["mean"] > 0.3 and outcomes["median"] < 0.1 and outcomes["krum"] < 0.1
