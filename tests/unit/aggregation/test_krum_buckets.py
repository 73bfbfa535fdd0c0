"""Krum over bucket means (Karimireddy et al. 2022): the bucket size it picks, its preconditions,
its seeding, that it spreads weight where plain Krum keeps the smallest update, and that it
still gives Byzantine updates no weight at all."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import pytest
import torch

from fedgrid.aggregation import AggregationPreconditionError, FedAvg, Krum, MultiKrum, build_strategy_from
from fedgrid.aggregation.selection import Sampling
from fedgrid.errors import ConfigError
from fedgrid.types import ClientInfo, FitRes


def _run(rule: Krum, updates: Sequence[torch.Tensor], seed: int = 0) -> torch.Tensor:
    rule.reset()
    rule.begin_round(seed=seed)
    for u in updates:
        rule.add(OrderedDict(w=u), 1.0)
    return rule.result()["w"]


@pytest.mark.parametrize(
    "f,n,expected",
    [
        (1, 10, 3),
        (1, 7, 2),
        (1, 6, 1),
        (2, 7, 1),
        (2, 10, 1),
        (2, 11, 2),
        (2, 20, 4),
        (0, 3, 1),
        (0, 10, 3),
        (3, 100, 16),
    ],
)
def test_bucket_size_is_the_largest_krum_allows(f, n, expected):
    """n > 2 s f + 2 (f = 0 chooses as f = 1), and never below 1 (plain Krum)."""
    rule = Krum(f=f)
    assert rule.bucket_size_for(n) == expected
    assert rule.problem(n) is None
    if expected > 1:
        assert n <= 2 * (expected + 1) * max(f, 1) + 2  # one more would break the condition
    assert Krum(f=f, bucket_size=5).bucket_size_for(n) == 5  # given, it is kept


def test_a_bucket_size_too_large_for_the_round_is_refused():
    rule = Krum(f=1, bucket_size=3)
    assert rule.problem(9) is None  # 9 > 2 * 3 * 1 + 2
    with pytest.raises(
        ConfigError,
        match=r"krum: bucket_size=3 lets f=1 Byzantine updates reach 3 of 8 buckets; "
        r"Krum needs more than 8 buckets, so at most bucket_size=2 for 8 updates",
    ):
        rule.check_preconditions(num_clients=8)
    with pytest.raises(AggregationPreconditionError, match="bucket_size=3"):
        _run(rule, [torch.full((2,), float(i)) for i in range(8)])
    with pytest.raises(
        ConfigError, match="needs more than 2f \\+ 2 = 4 updates per round to tolerate f=1, got 4"
    ):
        Krum(f=1).check_preconditions(num_clients=4)  # the plain condition comes first


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"bucket_size": 0}, "bucket_size must be a positive integer, got 0"),
        ({"bucket_size": True}, "bucket_size must be a positive integer, got True"),
        ({"resamplings": 0}, "resamplings must be a positive integer, got 0"),
        ({"resamplings": 2.5}, "resamplings must be a positive integer, got 2.5"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Krum(**kwargs)


def test_bucket_size_one_is_plain_krum():
    """Blanchard et al.'s rule, bit for bit, whatever the seed: the hand-computed cases hold."""
    values = [torch.tensor([v]) for v in (0.0, 1.0, 2.0, 100.0, 3.0, 4.0, 2.5, 1.5, 50.0, 0.5)]
    for seed in (0, 1, 2):
        rule = Krum(f=1, bucket_size=1)
        assert _run(rule, values, seed).tolist() == [
            2.0
        ]  # neighbours 1.5, 2.5, 1, 3, 0.5, 4, 0: the lowest sum
        assert rule.last_weights == [0.0, 0.0, 1.0] + [0.0] * 7


def test_weights_are_means_of_accepted_buckets_and_seeded():
    updates = [torch.tensor([float(i), float(i * i) / 10]) for i in range(10)]
    rule = Krum(f=1, resamplings=4)
    out = _run(rule, updates, seed=5)
    weights = torch.tensor(rule.last_weights, dtype=torch.float64)
    assert float(weights.sum()) == pytest.approx(1.0, abs=1e-12)
    # 4 shuffles, each keeping one bucket of 3 updates at 1/3: every weight is a multiple of 1/12.
    assert torch.allclose(weights * 12, (weights * 12).round(), atol=1e-9)
    expected = sum(w * u.double() for w, u in zip(weights, updates))
    torch.testing.assert_close(out, expected.float(), rtol=0, atol=1e-6)
    assert torch.equal(_run(Krum(f=1, resamplings=4), updates, seed=5), out)  # same seed, same bits
    draws = set()
    for seed in (5, 6, 7, 8):
        _run(rule, updates, seed=seed)
        draws.add(tuple(rule.last_weights))
    assert len(draws) > 1  # the seed draws the buckets


def test_strategies_seed_the_buckets_by_round():
    """The same round gives the same bits on a replay; another round draws other buckets."""
    gen = torch.Generator().manual_seed(3)
    deltas = [torch.randn(20, generator=gen) for _ in range(10)]

    def after(server_round: int, seed: int = 0) -> torch.Tensor:
        strategy = FedAvg(sampling=Sampling(seed=seed), aggregator=Krum(f=1))
        strategy.initialize(initial_state=OrderedDict(w=torch.zeros(20)))
        results = [
            FitRes(ClientInfo(client_id=f"id{i}", name=f"c{i:02d}"), OrderedDict(w=d.clone()), num_examples=5)
            for i, d in enumerate(deltas)
        ]
        strategy.aggregate(server_round=server_round, results=results[::-1], failures=[])  # any arrival order
        return strategy.global_state["w"]

    assert torch.equal(after(1), after(1))
    assert not torch.equal(after(1), after(2))
    assert not torch.equal(after(1), after(1, seed=1))


def test_buckets_spread_the_weight_plain_krum_puts_on_the_smallest_update():
    """The failure on non-IID clients: each client's update points at its own labels, and the
    client with the fewest examples moves least. Plain Krum keeps that one alone."""
    updates = [(0.2 if i == 0 else 1.0) * torch.eye(10)[i] for i in range(10)]
    plain = Krum(f=1, bucket_size=1)
    _run(plain, updates)
    assert plain.last_weights[0] == 1.0
    bucketed = Krum(f=1)
    _run(bucketed, updates, seed=3)
    assert max(bucketed.last_weights) <= 0.2 and sum(w > 0 for w in bucketed.last_weights) >= 8


def test_buckets_land_nearer_the_mean_of_heterogeneous_updates():
    """50 seeded draws of 20 honest updates that disagree (noise twice the signal): buckets
    of 4 (f = 2) land ~6x nearer the mean than plain Krum (observed mean error 0.25 vs 1.47)."""
    plain_errors, bucket_errors = [], []
    for trial in range(50):
        gen = torch.Generator().manual_seed(trial)
        updates = [torch.ones(50) + 2.0 * torch.randn(50, generator=gen) for _ in range(20)]
        mean = torch.stack(updates).mean(dim=0)
        for rule, errors in ((Krum(f=2, bucket_size=1), plain_errors), (Krum(f=2), bucket_errors)):
            errors.append(float((_run(rule, updates, seed=trial) - mean).norm() / mean.norm()))
    assert sum(bucket_errors) / 50 < 0.35 and max(bucket_errors) < 0.5
    assert sum(bucket_errors) < 0.3 * sum(plain_errors)


@pytest.mark.parametrize("attack", ["large-norm", "sign-flip"])
@pytest.mark.parametrize("n,f", [(10, 1), (20, 2), (30, 3)])
def test_bucketed_krum_gives_byzantine_updates_no_weight(attack, n, f):
    """f attackers among n (the last f): every bucket holding one is rejected in every shuffle,
    so the result is a mean of honest updates only, near their mean."""
    gen = torch.Generator().manual_seed(n)
    honest = [torch.ones(50) + 0.5 * torch.randn(50, generator=gen) for _ in range(n - f)]
    if attack == "large-norm":
        byzantine = [100.0 * torch.randn(50, generator=gen) for _ in range(f)]
    else:
        byzantine = [-10.0 * h for h in honest[:f]]
    honest_mean = torch.stack(honest).mean(dim=0)
    rule = Krum(f=f)
    assert rule.bucket_size_for(n) > 1
    for seed in range(5):
        out = _run(rule, honest + byzantine, seed=seed)
        assert rule.last_weights[n - f :] == [0.0] * f
        assert float((out - honest_mean).norm() / honest_mean.norm()) < 0.25  # one honest update is ~0.5 off


def test_multi_krum_does_not_bucket():
    """The m best-scored updates, each at 1/m: 2.5, 2 and 3 (scores 18.5, 19.5, 21.5; 1.5 has 24.5)."""
    values = [torch.tensor([v]) for v in (0.0, 1.0, 2.0, 100.0, 3.0, 4.0, 2.5, 1.5, 50.0, 5.0)]
    rule = MultiKrum(f=1, m=3)
    assert rule.bucket_size_for(10) == 1
    assert _run(rule, values).tolist() == pytest.approx([2.5])
    assert rule.selected() == [2, 4, 6]
    assert rule.last_weights == pytest.approx([0, 0, 1 / 3, 0, 1 / 3, 0, 1 / 3, 0, 0, 0])


def test_registry_builds_bucket_options():
    strategy = build_strategy_from(
        "fedavg", aggregator="krum", aggregator_f=2, aggregator_bucket_size=2, aggregator_resamplings=3
    )
    rule = strategy.aggregator  # type: ignore[attr-defined]
    assert isinstance(rule, Krum) and (rule.f, rule.bucket_size, rule.resamplings) == (2, 2, 3)
    with pytest.raises(ConfigError, match="krum: bucket_size=2 lets f=2"):
        strategy.check_preconditions(num_clients=10)
    with pytest.raises(ConfigError, match="multi-krum takes no option 'bucket_size'"):
        build_strategy_from("fedavg", aggregator="multi-krum", aggregator_bucket_size=2)
