"""Datasets that need no download, and reproducible partitioners.

``load_digits`` uses scikit-learn's bundled digits (1,797 8x8 images, 10 classes): the
zero-setup default. ``load_fashion_mnist`` reads the idx.gz files of Fashion-MNIST (or
MNIST) from a folder, for benchmarks on real data. ``load_synthetic`` generates LEAF's
Synthetic(alpha, beta) data (no files). Partitioners split example indices among clients
from a seed alone, so a client process given ``--partition I/N --seed S`` holds exactly
what simulation gives client I:

- ``iid``: shuffled, near-equal parts;
- ``dirichlet:ALPHA``: each class divided among clients by a Dirichlet(ALPHA) draw;
- ``shards:N`` (McMahan et al. 2017): examples sorted by label are cut into
  ``clients * N`` equal shards and every client is dealt ``N`` random shards, so it holds
  at most ``2 * N`` classes (when a shard is no larger than the smallest class);
- ``natural``: the data's own groups (Shakespeare's speaking roles, synthetic devices).

``DatasetData`` is a loaded dataset (one of these, or Shakespeare's) as the built-in tasks
(``fedgrid.simulation.tasks``) use it.
"""

from __future__ import annotations

import gzip
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedgrid.errors import ConfigError

__all__ = [
    "Dataset",
    "DatasetData",
    "load_digits",
    "read_idx",
    "load_fashion_mnist",
    "partition",
    "partition_iid",
    "partition_dirichlet",
    "partition_shards",
    "parse_partition",
    "load_synthetic",
    "PARTITIONERS",
]

#: The partitioner specs ``parse_partition`` knows, as its error messages list them.
PARTITIONERS = ("iid", "dirichlet:ALPHA", "shards:N", "natural")

#: The test split is fixed (independent of the run's seed) so accuracies compare across runs.
_SPLIT_SEED = 1234


@dataclass(frozen=True)
class Dataset:
    """A train/test split; ``train_groups`` / ``test_groups`` give each example's natural
    group (``None``: the data has none, so the ``natural`` partitioner does not apply)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    train_groups: np.ndarray | None = None
    test_groups: np.ndarray | None = None


def load_digits(test_fraction: float = 0.2) -> Dataset:
    """scikit-learn's digits, pixels scaled to [0, 1], split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits as _load

    bunch = _load()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.int64)
    order = torch.from_numpy(np.random.default_rng(_SPLIT_SEED).permutation(len(y)))
    n_test = int(round(test_fraction * len(y)))
    test, train = order[:n_test], order[n_test:]
    return Dataset(x[train], y[train], x[test], y[test], num_classes=10)


#: idx type byte -> the big-endian dtype of the data that follows the header.
_IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Reads one idx file (``.gz`` or plain): two zero bytes, a type byte, the number of
    dimensions, one big-endian uint32 per dimension, then the data.

    Raises:
        ValueError: a malformed header or a size that does not match the dimensions.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_TYPES:
        raise ValueError(f"{path}: not an idx file")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    dtype = _IDX_TYPES[data[2]]
    body = data[4 + 4 * ndim :]
    if len(body) != math.prod(dims) * dtype.itemsize:
        raise ValueError(f"{path}: {len(body)} data bytes for dimensions {dims}")
    return np.frombuffer(body, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


def load_fashion_mnist(root: str | os.PathLike[str]) -> Dataset:
    """Fashion-MNIST (or MNIST) from the four idx.gz files in ``root``: images as
    ``(N, 1, 28, 28)`` float32 in [0, 1], the given 60k/10k train/test split.

    Raises:
        FileNotFoundError: a file is missing.
    """
    base = Path(root)

    def images(name: str) -> torch.Tensor:
        return torch.from_numpy(read_idx(base / name).astype(np.float32) / 255.0).unsqueeze(1)

    def labels(name: str) -> torch.Tensor:
        return torch.from_numpy(read_idx(base / name).astype(np.int64))

    return Dataset(
        images("train-images-idx3-ubyte.gz"),
        labels("train-labels-idx1-ubyte.gz"),
        images("t10k-images-idx3-ubyte.gz"),
        labels("t10k-labels-idx1-ubyte.gz"),
        num_classes=10,
    )


def partition_iid(num_examples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """Shuffles and deals examples into ``num_clients`` near-equal parts."""
    order = np.random.default_rng(seed).permutation(num_examples)
    return [np.sort(part) for part in np.array_split(order, num_clients)]


def partition_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    seed: int,
    *,
    min_size: int = 10,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Label-skewed split: each class is divided among clients by a Dirichlet(alpha) draw.

    Smaller ``alpha`` means more skew. Draws repeat (from the same generator) until every
    client holds at least ``min_size`` examples.

    Raises:
        ValueError: no draw gave every client ``min_size`` examples.
    """
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for cls in classes:
            idx = rng.permutation(np.flatnonzero(labels == cls))
            shares = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(shares) * len(idx)).astype(int)[:-1]
            for client, piece in enumerate(np.split(idx, cuts)):
                parts[client].extend(piece.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ValueError(f"no Dirichlet({alpha}) split gave {num_clients} clients {min_size} examples each")


def partition_shards(
    labels: np.ndarray, num_clients: int, shards_per_client: int, seed: int
) -> list[np.ndarray]:
    """McMahan et al. 2017's pathological non-IID split: sorts examples by label (stable),
    cuts them into ``num_clients * shards_per_client`` near-equal shards and deals
    ``shards_per_client`` random shards to each client.

    Raises:
        ConfigError: fewer examples than shards (names ``partition``).
    """
    num_shards = num_clients * shards_per_client
    if num_shards > len(labels):
        raise ConfigError(
            "partition",
            f"shards:{shards_per_client} cuts {num_shards} shards from only {len(labels)} examples",
        )
    order = np.argsort(np.asarray(labels), kind="stable")
    shards = np.array_split(order, num_shards)
    dealt = np.random.default_rng(seed).permutation(num_shards).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([shards[i] for i in row])).astype(np.int64) for row in dealt]


def load_synthetic(
    alpha: float = 1.0,
    beta: float = 1.0,
    *,
    num_devices: int = 100,
    dim: int = 60,
    num_classes: int = 10,
    max_per_device: int = 1000,
    test_fraction: float = 0.2,
    seed: int = _SPLIT_SEED,
) -> Dataset:
    """LEAF's / FedProx's Synthetic(alpha, beta): ``num_devices`` devices, each with its own
    logistic-regression model and input distribution. Generated from ``seed``; no files.

    Device k draws ``u_k ~ N(0, alpha)``, ``W_k ~ N(u_k, 1)`` (dim x classes), ``b_k ~
    N(u_k, 1)``, ``B_k ~ N(0, beta)``, ``v_k ~ N(B_k, 1)`` (dim); its inputs are ``x ~
    N(v_k, diag(j^-1.2))`` and labels ``y = argmax(x W_k + b_k)``; as in LEAF's generator,
    alpha and beta are standard deviations. alpha controls how much the devices' models
    differ, beta how much their inputs do. A device holds
    ``50 + lognormal(4, 2)`` examples (LEAF's sizes) capped at ``max_per_device``; the last
    ``test_fraction`` of each device's examples is its test split. ``train_groups`` /
    ``test_groups`` hold the device of each example (the ``natural`` partition).
    """
    rng = np.random.default_rng(seed)
    sizes = np.minimum(50 + rng.lognormal(4, 2, num_devices).astype(np.int64), max_per_device)
    u = rng.normal(0.0, alpha, num_devices)
    big_b = rng.normal(0.0, beta, num_devices)
    std = np.arange(1, dim + 1, dtype=np.float64) ** (-1.2 / 2)
    xs, ys, groups, is_test = [], [], [], []
    for k in range(num_devices):
        w = rng.normal(u[k], 1.0, (dim, num_classes))
        b = rng.normal(u[k], 1.0, num_classes)
        v = rng.normal(big_b[k], 1.0, dim)
        x = v + std * rng.standard_normal((int(sizes[k]), dim))
        xs.append(x)
        ys.append(np.argmax(x @ w + b, axis=1))
        groups.append(np.full(int(sizes[k]), k, dtype=np.int64))
        n_test = int(round(test_fraction * int(sizes[k])))
        is_test.append(np.arange(int(sizes[k])) >= int(sizes[k]) - n_test)
    x_all = torch.from_numpy(np.concatenate(xs).astype(np.float32))
    y_all = torch.from_numpy(np.concatenate(ys).astype(np.int64))
    g_all = np.concatenate(groups)
    test = np.concatenate(is_test)
    train_idx, test_idx = torch.from_numpy(np.flatnonzero(~test)), torch.from_numpy(np.flatnonzero(test))
    return Dataset(
        x_all[train_idx],
        y_all[train_idx],
        x_all[test_idx],
        y_all[test_idx],
        num_classes=num_classes,
        train_groups=g_all[~test],
        test_groups=g_all[test],
    )


def parse_partition(spec: str) -> tuple[str, float | None]:
    """Parses ``iid``, ``dirichlet[:ALPHA]`` (default 0.5), ``shards:N`` (N shards per
    client: no default, since N sets how skewed the split is) or ``natural``.

    Returns:
        ``(name, parameter)``: alpha for dirichlet, N (an int) for shards, else ``None``.

    Raises:
        ConfigError: unknown partitioner or bad parameter (names ``partition``).
    """
    name, _, param = spec.partition(":")
    if name in ("iid", "natural") and ":" not in spec:
        return name, None
    if name == "dirichlet":
        try:
            alpha = float(param) if param else 0.5
        except ValueError:
            raise ConfigError("partition", f"dirichlet needs a number, got {param!r}") from None
        if not (alpha > 0 and math.isfinite(alpha)):
            raise ConfigError("partition", f"dirichlet alpha must be positive, got {alpha}")
        return "dirichlet", alpha
    if name == "shards":
        if not param:
            raise ConfigError(
                "partition", f"{spec!r} needs the shards per client: expected shards:N, e.g. shards:2"
            )
        try:
            shards = int(param)
        except ValueError:
            raise ConfigError(
                "partition", f"shards needs a whole number of shards per client, got {param!r}"
            ) from None
        if shards < 1:
            raise ConfigError("partition", f"shards per client must be at least 1, got {shards}")
        return "shards", shards
    raise ConfigError("partition", f"unknown partitioner {spec!r} (known: {', '.join(PARTITIONERS)})")


def partition(
    labels: np.ndarray, num_clients: int, spec: str, seed: int, *, groups: np.ndarray | None = None
) -> list[np.ndarray]:
    """Splits example indices among ``num_clients`` by ``spec`` (see ``parse_partition``).

    Args:
        labels: each example's class (``iid`` uses only their number).
        groups: each example's natural group, for ``natural`` (Shakespeare's roles).

    Raises:
        ConfigError: a bad spec, no clients, or ``natural`` without groups.
    """
    if num_clients < 1:
        raise ConfigError("clients", f"must be at least 1, got {num_clients}")
    name, param = parse_partition(spec)
    if name == "iid":
        return partition_iid(len(labels), num_clients, seed)
    if name == "shards":
        assert param is not None
        return partition_shards(labels, num_clients, int(param), seed)
    if name == "natural":
        if groups is None:
            raise ConfigError("partition", "natural needs data with natural groups (shakespeare, synthetic)")
        from fedgrid.simulation.shakespeare import partition_natural

        return partition_natural(np.asarray(groups), num_clients)
    assert param is not None
    return partition_dirichlet(labels, num_clients, param, seed)


#: Seed of the fixed subset of test examples a server-side evaluation uses (``DatasetData.eval_index``).
_EVAL_SEED = 4321


class DatasetData:
    """A loaded dataset as the tasks use it: labels and groups up front, inputs gathered
    per subset (Shakespeare's full window matrix would take ~2.4 GB).

    Attributes:
        y_train, y_test: int64 labels.
        train_groups, test_groups: each example's natural group, or ``None``.
        eval_index: the test examples the server-side evaluation uses (``None``: all).
    """

    def __init__(self, source: Any, *, eval_limit: int | None = None) -> None:
        self.source = source
        self.char = not isinstance(source, Dataset)  # Shakespeare's CharData
        self.y_train: torch.Tensor = source.y_train
        self.y_test: torch.Tensor = source.y_test
        self.num_classes: int = source.num_classes
        groups = ("train_roles", "test_roles") if self.char else ("train_groups", "test_groups")
        self.train_groups: np.ndarray | None = getattr(source, groups[0])
        self.test_groups: np.ndarray | None = getattr(source, groups[1])
        n = len(self.y_test)
        self.eval_index: torch.Tensor | None = None
        if eval_limit is not None and n > eval_limit:  # a fixed subset, the same in every run
            self.eval_index = torch.from_numpy(
                np.sort(np.random.default_rng(_EVAL_SEED).choice(n, eval_limit, replace=False))
            )

    def train(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels of the chosen training examples."""
        if self.char:
            return self.source.windows("train", index)
        return self.source.x_train[index], self.source.y_train[index]

    def test(self, index: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels of the chosen test examples."""
        if self.char:
            return self.source.windows("test", index)
        return self.source.x_test[index], self.source.y_test[index]
