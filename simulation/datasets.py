"""Datasets that need no download, and reproducible partitioners.

``load_digits`` uses scikit-learn's bundled digits (1,797 8x8 images, 10 classes): the
zero-setup default. ``load_fashion_mnist`` reads the idx.gz files of Fashion-MNIST (or
MNIST) from a folder, for benchmarks on real data. Partitioners split example indices among clients from a seed alone,
so a client process given ``--partition I/N --seed S`` holds exactly what simulation gives
client I.
"""

from __future__ import annotations

import gzip
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedgrid.errors import ConfigError

__all__ = [
    "Dataset",
    "load_digits",
    "read_idx",
    "load_fashion_mnist",
    "partition",
    "partition_iid",
    "partition_dirichlet",
    "parse_partition",
]

#: The test split is fixed (independent of the run's seed) so accuracies compare across runs.
_SPLIT_SEED = 1234


@dataclass(frozen=True)
class Dataset:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int


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
    labels: np.ndarray, num_clients: int, alpha: float, seed: int, *, min_size: int = 10, max_tries: int = 1000
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


def parse_partition(spec: str) -> tuple[str, float | None]:
    """Parses ``iid`` or ``dirichlet:ALPHA``.

    Raises:
        ConfigError: unknown partitioner or bad parameter.
    """
    name, _, param = spec.partition(":")
    if name == "iid" and not param:
        return "iid", None
    if name == "dirichlet":
        try:
            alpha = float(param) if param else 0.5
        except ValueError:
            raise ConfigError("partition", f"dirichlet needs a number, got {param!r}") from None
        if not (alpha > 0 and math.isfinite(alpha)):
            raise ConfigError("partition", f"dirichlet alpha must be positive, got {alpha}")
        return "dirichlet", alpha
    raise ConfigError("partition", f"unknown partitioner {spec!r} (known: iid, dirichlet:ALPHA)")


def partition(labels: np.ndarray, num_clients: int, spec: str, seed: int) -> list[np.ndarray]:
    """Splits example indices among ``num_clients`` by ``spec`` (``iid`` or ``dirichlet:ALPHA``)."""
    if num_clients < 1:
        raise ConfigError("clients", f"must be at least 1, got {num_clients}")
    name, alpha = parse_partition(spec)
    if name == "iid":
        return partition_iid(len(labels), num_clients, seed)
    assert alpha is not None
    return partition_dirichlet(labels, num_clients, alpha, seed)
