"""Unit tests of the partitioners: iid, dirichlet:ALPHA, shards:N and natural through ``partition``.

Every partitioner is reproducible from the seed, assigns every example exactly once, and
skews labels as its model says (numbers asserted, not just "it ran").
"""

from __future__ import annotations

import numpy as np
import pytest

from fedgrid.errors import ConfigError
from fedgrid.simulation.datasets import (
    load_synthetic,
    parse_partition,
    partition,
    partition_dirichlet,
    partition_shards,
)

# 10 balanced classes of 100 examples, in class order (the worst case for a naive split)
LABELS = np.repeat(np.arange(10), 100)
# unbalanced classes (100, 95, ..., 55 examples), shuffled
UNEVEN = np.random.default_rng(0).permutation(np.repeat(np.arange(10), np.arange(100, 50, -5)))
# natural groups: 40 groups of 3..42 examples
GROUPS = np.random.default_rng(1).permutation(np.repeat(np.arange(40), np.arange(3, 43)))
SPECS = ["iid", "dirichlet:0.3", "shards:2", "shards:3"]


def _assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    joined = np.concatenate(parts)
    assert len(joined) == n
    assert np.array_equal(np.sort(joined), np.arange(n))
    for p in parts:
        assert p.dtype == np.int64 and np.array_equal(p, np.sort(p))


def _classes_for_90_percent(parts: list[np.ndarray], labels: np.ndarray) -> float:
    """Mean over clients of the fewest classes holding 90% of a client's examples."""
    counts = []
    for p in parts:
        per_class = np.sort(np.bincount(labels[p], minlength=10))[::-1]
        counts.append(int(np.searchsorted(np.cumsum(per_class), 0.9 * len(p))) + 1)
    return float(np.mean(counts))


@pytest.mark.parametrize("labels", [LABELS, UNEVEN], ids=["balanced", "uneven"])
@pytest.mark.parametrize("spec", SPECS)
def test_every_example_assigned_exactly_once(spec, labels):
    for clients in (1, 7, 10):
        parts = partition(labels, clients, spec, seed=4)
        assert len(parts) == clients
        _assert_exact_cover(parts, len(labels))


@pytest.mark.parametrize("spec", [*SPECS, "natural"])
def test_reproducible_from_the_seed(spec):
    a = partition(LABELS, 8, spec, seed=11, groups=GROUPS[: len(LABELS)] if spec == "natural" else None)
    b = partition(LABELS, 8, spec, seed=11, groups=GROUPS[: len(LABELS)] if spec == "natural" else None)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    if spec != "natural":  # natural is a fixed function of the groups
        c = partition(LABELS, 8, spec, seed=12)
        assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_dirichlet_label_skew_follows_alpha():
    skewed = np.mean(
        [_classes_for_90_percent(partition(LABELS, 10, "dirichlet:0.1", seed=s), LABELS) for s in range(5)]
    )
    middle = np.mean(
        [_classes_for_90_percent(partition(LABELS, 10, "dirichlet:0.5", seed=s), LABELS) for s in range(5)]
    )
    even = np.mean(
        [_classes_for_90_percent(partition(LABELS, 10, "dirichlet:100", seed=s), LABELS) for s in range(5)]
    )
    # balanced classes: a client holding all ten equally needs 9 of them for 90%
    assert even == pytest.approx(9.0, abs=0.3)
    assert skewed < 4.0  # measured 3.06 over these seeds
    assert skewed < middle < even
    assert even - skewed > 5.0


def test_dirichlet_through_partition_matches_the_function():
    parts = partition(UNEVEN, 6, "dirichlet:0.7", seed=3)
    direct = partition_dirichlet(UNEVEN, 6, 0.7, 3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, direct, strict=True))


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("labels", [LABELS, UNEVEN], ids=["balanced", "uneven"])
def test_shards_give_each_client_at_most_2n_classes(labels, n):
    for seed in range(3):
        parts = partition_shards(labels, 10, n, seed)
        _assert_exact_cover(parts, len(labels))
        assert max(len(np.unique(labels[p])) for p in parts) <= 2 * n
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= n  # equal shards, up to one example each


def test_shards_aligned_with_classes_give_exactly_n_classes():
    # 10 clients x 2 shards of 50 over classes of 100: every shard is one class
    for seed in range(3):
        parts = partition(LABELS, 10, "shards:2", seed=seed)
        assert max(len(np.unique(LABELS[p])) for p in parts) <= 2
        assert _classes_for_90_percent(parts, LABELS) <= 2.0
    iid = np.mean([_classes_for_90_percent(partition(LABELS, 10, "iid", seed=s), LABELS) for s in range(3)])
    assert iid > 8.0


def test_shards_more_than_examples_is_a_config_error():
    with pytest.raises(ConfigError, match="cuts 40 shards from only 30 examples") as info:
        partition(LABELS[:30], 20, "shards:2", seed=0)
    assert info.value.key == "partition"


def test_natural_keeps_each_group_on_one_client():
    parts = partition(np.zeros(len(GROUPS), dtype=np.int64), 9, "natural", seed=0, groups=GROUPS)
    _assert_exact_cover(parts, len(GROUPS))
    owner = {}
    for client, p in enumerate(parts):
        for g in np.unique(GROUPS[p]):
            assert owner.setdefault(int(g), client) == client
    assert len(owner) == 40
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 42  # balanced up to one group


def test_natural_without_groups_names_partition():
    with pytest.raises(ConfigError, match="natural needs data with natural groups") as info:
        partition(LABELS, 4, "natural", seed=0)
    assert info.value.key == "partition"


def test_natural_on_synthetic_devices():
    data = load_synthetic(num_devices=12, max_per_device=80)
    parts = partition(data.y_train.numpy(), 12, "natural", seed=0, groups=data.train_groups)
    assert data.train_groups is not None
    assert sorted(len(np.unique(data.train_groups[p])) for p in parts) == [1] * 12  # one device per client


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("shards:2", ("shards", 2)),
        ("shards:5", ("shards", 5)),
        ("natural", ("natural", None)),
        ("iid", ("iid", None)),
    ],
)
def test_parse_new_specs(spec, expected):
    assert parse_partition(spec) == expected


@pytest.mark.parametrize(
    "spec,words",
    [
        ("shards:0", "shards per client must be at least 1, got 0"),
        ("shards:-2", "shards per client must be at least 1"),
        ("shards:2.5", "shards needs a whole number of shards per client, got '2.5'"),
        ("shards:x", "shards needs a whole number"),
        ("shards", r"'shards' needs the shards per client: expected shards:N"),
        ("shards:", r"'shards:' needs the shards per client: expected shards:N"),
        ("natural:3", "unknown partitioner 'natural:3'"),
        (
            "pathological",
            r"unknown partitioner 'pathological' \(known: iid, dirichlet:ALPHA, shards:N, natural\)",
        ),
    ],
)
def test_bad_specs_name_partition(spec, words):
    with pytest.raises(ConfigError, match=words) as info:
        partition(LABELS, 4, spec, seed=0)
    assert info.value.key == "partition"
