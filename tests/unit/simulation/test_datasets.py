"""Unit tests of ``fedgrid.simulation.datasets``: the digits loader and the partitioners."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedgrid.errors import ConfigError
from fedgrid.simulation.datasets import (
    load_digits,
    parse_partition,
    partition,
    partition_dirichlet,
    partition_iid,
)

# 10 balanced classes of 100 examples, in class order (the worst case for a naive split)
LABELS = np.repeat(np.arange(10), 100)


def _assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    """Every index in 0..n-1 is held by exactly one client, and each part is sorted."""
    joined = np.concatenate(parts)
    assert len(joined) == n
    assert np.array_equal(np.sort(joined), np.arange(n))
    for p in parts:
        assert np.array_equal(p, np.sort(p))


def _mean_max_class_share(parts: list[np.ndarray], labels: np.ndarray) -> float:
    shares = [np.bincount(labels[p], minlength=10).max() / len(p) for p in parts]
    return float(np.mean(shares))


# -- iid -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n,clients", [(1000, 10), (1001, 7), (5, 5), (3, 1), (0, 2)])
def test_iid_exact_cover_and_near_equal(n, clients):
    parts = partition_iid(n, clients, seed=3)
    assert len(parts) == clients
    _assert_exact_cover(parts, n)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def test_iid_reproducible_and_seed_dependent():
    a = partition_iid(1000, 10, seed=0)
    b = partition_iid(1000, 10, seed=0)
    c = partition_iid(1000, 10, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_iid_is_shuffled():
    parts = partition_iid(1000, 10, seed=0)
    assert not np.array_equal(parts[0], np.arange(100))
    # an iid share of a class-ordered dataset holds every class
    assert all(len(np.unique(LABELS[p])) == 10 for p in parts)


# -- dirichlet -----------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.1, 0.5, 100.0])
def test_dirichlet_exact_cover_and_min_size(alpha):
    parts = partition_dirichlet(LABELS, 10, alpha, seed=5, min_size=20)
    assert len(parts) == 10
    _assert_exact_cover(parts, len(LABELS))
    assert min(len(p) for p in parts) >= 20
    assert all(p.dtype == np.int64 for p in parts)


def test_dirichlet_reproducible_and_seed_dependent():
    a = partition_dirichlet(LABELS, 8, 0.5, seed=0)
    b = partition_dirichlet(LABELS, 8, 0.5, seed=0)
    c = partition_dirichlet(LABELS, 8, 0.5, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_dirichlet_small_alpha_skews_labels():
    skewed = np.mean(
        [_mean_max_class_share(partition_dirichlet(LABELS, 10, 0.1, seed=s), LABELS) for s in range(5)]
    )
    even = np.mean(
        [_mean_max_class_share(partition_dirichlet(LABELS, 10, 100.0, seed=s), LABELS) for s in range(5)]
    )
    # balanced data: a client holding every class equally has max share 0.1
    assert even < 0.2
    assert skewed > 0.45
    assert skewed > 2.5 * even


def test_dirichlet_unreachable_min_size_raises():
    with pytest.raises(ValueError, match=r"no Dirichlet\(0.5\) split gave 20 clients 60 examples each"):
        partition_dirichlet(LABELS, 20, 0.5, seed=0, min_size=60, max_tries=5)


def test_dirichlet_retries_until_min_size():
    # min_size=0 accepts the first draw; a larger min_size draws again from the same generator
    first = partition_dirichlet(LABELS, 10, 0.1, seed=1, min_size=0)
    assert min(len(p) for p in first) == 0  # seed 1's first draw leaves a client empty
    retried = partition_dirichlet(LABELS, 10, 0.1, seed=1, min_size=40)
    assert min(len(p) for p in retried) >= 40
    assert not all(np.array_equal(a, b) for a, b in zip(first, retried))
    _assert_exact_cover(retried, len(LABELS))


# -- partition() and parse_partition() -----------------------------------------------------
@pytest.mark.parametrize(
    "spec,expected",
    [
        ("iid", ("iid", None)),
        ("dirichlet:0.3", ("dirichlet", 0.3)),
        ("dirichlet", ("dirichlet", 0.5)),
        ("dirichlet:", ("dirichlet", 0.5)),
        ("dirichlet:1e2", ("dirichlet", 100.0)),
    ],
)
def test_parse_partition(spec, expected):
    assert parse_partition(spec) == expected


@pytest.mark.parametrize(
    "spec,words",
    [
        ("foo", "unknown partitioner 'foo'"),
        ("", "unknown partitioner ''"),
        ("iid:3", "unknown partitioner 'iid:3'"),
        ("IID", "unknown partitioner 'IID'"),
        ("dirichlet:abc", "dirichlet needs a number, got 'abc'"),
        ("dirichlet:0", "alpha must be positive, got 0.0"),
        ("dirichlet:-1", "alpha must be positive, got -1.0"),
        ("dirichlet:nan", "alpha must be positive, got nan"),
    ],
)
def test_parse_partition_errors(spec, words):
    with pytest.raises(ConfigError, match=words) as info:
        parse_partition(spec)
    assert info.value.key == "partition"


def test_parse_partition_rejects_infinite_alpha():
    with pytest.raises(ConfigError):
        parse_partition("dirichlet:inf")


def test_partition_dispatches_by_spec():
    iid = partition(LABELS, 4, "iid", seed=9)
    assert all(np.array_equal(a, b) for a, b in zip(iid, partition_iid(len(LABELS), 4, 9)))
    dirichlet = partition(LABELS, 4, "dirichlet:0.7", seed=9)
    assert all(np.array_equal(a, b) for a, b in zip(dirichlet, partition_dirichlet(LABELS, 4, 0.7, 9)))


def test_partition_rejects_no_clients():
    with pytest.raises(ConfigError, match="must be at least 1, got 0") as info:
        partition(LABELS, 0, "iid", seed=0)
    assert info.value.key == "clients"


def test_load_digits_split_is_fixed():
    a, b = load_digits(), load_digits()
    assert a.x_train.shape == (1438, 64) and a.x_test.shape == (359, 64)  # round(0.2 * 1797) test examples
    assert a.y_train.dtype == torch.int64 and a.num_classes == 10
    assert float(a.x_train.min()) == 0.0 and float(a.x_train.max()) == 1.0
    assert torch.equal(a.x_test, b.x_test) and torch.equal(a.y_train, b.y_train)
    assert sorted(torch.unique(a.y_test).tolist()) == list(range(10))


def test_read_idx_round_trip_and_bad_files(tmp_path):
    import gzip

    from fedgrid.simulation.datasets import read_idx

    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    header = bytes([0, 0, 0x08, 3]) + b"".join(d.to_bytes(4, "big") for d in images.shape)
    path = tmp_path / "x-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(header + images.tobytes()))
    assert np.array_equal(read_idx(path), images)
    wide = np.array([1, -2, 70000], dtype=">i4")  # big-endian int32 in the file, native in memory
    plain = tmp_path / "y-idx1-ubyte"
    plain.write_bytes(bytes([0, 0, 0x0C, 1]) + (3).to_bytes(4, "big") + wide.tobytes())
    assert read_idx(plain).tolist() == [1, -2, 70000]
    (tmp_path / "short").write_bytes(header + images.tobytes()[:-1])
    with pytest.raises(ValueError, match="data bytes for dimensions"):
        read_idx(tmp_path / "short")
    (tmp_path / "bad").write_bytes(b"\x01\x00\x08\x01")
    with pytest.raises(ValueError, match="not an idx file"):
        read_idx(tmp_path / "bad")
