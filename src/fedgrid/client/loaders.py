"""Plain data loaders read by indexing.

A ``DataLoader`` over a ``TensorDataset`` (or a ``Subset`` of one) with ``num_workers=0``,
the default collate and a ``RandomSampler`` or ``SequentialSampler`` fetches a batch one
example at a time and stacks them: per batch, a Python call per example. Indexing the
dataset's tensors with the batch's indices gives the same tensors (``default_collate``
stacks the very rows ``tensor[indices]`` selects) in one call per tensor.

``PlainLoader.batches`` yields exactly what ``iter(loader)`` yields, and draws exactly what
it draws from torch's random generators, in the same order and at the same point: the
iterator's base seed, then the sampler's seed (or its permutation from the loader's own
generator), when an epoch starts. Code that runs between batches (dropout, say) therefore
sees the same random stream either way. ``TorchClient`` trains through it (the sequential
engine and a deployed client), and the batched simulation engine takes its batch order
from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterator

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    SequentialSampler,
    Subset,
    TensorDataset,
)
from torch.utils.data._utils.collate import default_collate

__all__ = ["NotPlainLoader", "PlainLoader", "plain_loader"]


class NotPlainLoader(ValueError):
    """The loader is not one ``PlainLoader`` can stand in for; the message says why."""


@dataclass(frozen=True)
class PlainLoader:
    """What a plain ``DataLoader`` reads (see the module docstring).

    Attributes:
        base: the ``TensorDataset`` under any ``Subset`` layers, of (inputs, targets).
        local: the rows of ``base`` the loader reads (the ``Subset`` indices), or ``None`` for all.
        batch_size, shuffle, drop_last, generator: the loader's own.
    """

    base: TensorDataset
    local: torch.Tensor | None
    batch_size: int
    shuffle: bool
    drop_last: bool
    generator: torch.Generator | None

    def __len__(self) -> int:
        """Examples per epoch."""
        return len(self.local) if self.local is not None else len(self.base)

    def order(self) -> torch.Tensor:
        """One epoch's order of positions ``0..len-1``, drawing from the RNGs what ``iter(loader)`` draws.

        A look-alike loader over ``range(n)`` with one batch of ``n`` runs the loader's own
        code for its seeds and sampler, whatever the batch size.
        """
        if len(self) == 0:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat(list(self._lookalike))

    @cached_property
    def _lookalike(self) -> DataLoader:
        """Made once: each ``iter`` of it draws anew, as each ``iter`` of the client's loader
        does. Its dataset hands over the whole batch of positions in one call (no
        per-example fetch and collate)."""
        n = len(self)
        return DataLoader(
            _Positions(n), batch_size=n, shuffle=self.shuffle, generator=self.generator, collate_fn=_as_is
        )

    def index_batches(self, order: torch.Tensor) -> list[torch.Tensor]:
        """``order`` cut into the loader's batches of positions (the last one dropped if short and ``drop_last``)."""
        cut = list(order.split(self.batch_size))
        if cut and self.drop_last and len(cut[-1]) < self.batch_size:
            cut.pop()
        return cut

    def batches(self) -> Iterator[list[torch.Tensor]]:
        """One epoch: ``[inputs, targets]`` batches equal to the loader's (``default_collate`` gives a list too)."""
        order = self.order()
        rows = order if self.local is None else self.local[order]
        x, y = self.base.tensors
        for pick in self.index_batches(rows):
            yield [x[pick], y[pick]]


class _Positions(Dataset):
    """``0..n-1``, fetched a batch at a time (``DataLoader`` calls ``__getitems__`` with the batch)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        return torch.as_tensor(indices, dtype=torch.int64)


def _as_is(batch: Any) -> Any:
    """The collate of ``_Positions``: its ``__getitems__`` already made the batch."""
    return batch


def _reads_as(dataset: object, kind: type) -> bool:
    """``dataset`` fetches examples as ``kind`` does (a subclass that overrides ``__getitem__``,
    to transform or augment, does not)."""
    return all(
        getattr(type(dataset), m, None) is getattr(kind, m, None) for m in ("__getitem__", "__getitems__")
    )


def _dataset_of(loader: DataLoader) -> tuple[TensorDataset, torch.Tensor | None]:
    dataset, local = loader.dataset, None
    while isinstance(dataset, Subset) and _reads_as(dataset, Subset):
        idx = torch.as_tensor(list(dataset.indices), dtype=torch.int64)
        local = idx if local is None else idx[local]
        dataset = dataset.dataset
    if (
        not (isinstance(dataset, TensorDataset) and _reads_as(dataset, TensorDataset))
        or len(dataset.tensors) != 2
    ):
        raise NotPlainLoader(
            f"its dataset is {type(dataset).__name__}, not a TensorDataset of (inputs, targets) or a Subset of one "
            "(read through their own __getitem__)"
        )
    return dataset, local


def plain_loader(loader: object) -> PlainLoader:
    """``loader`` as a ``PlainLoader``.

    Raises:
        NotPlainLoader: it is not a plain ``DataLoader`` (the message names what is not).
    """
    if not isinstance(loader, DataLoader):
        raise NotPlainLoader(f"its train_loader is a {type(loader).__name__}, not a torch DataLoader")
    if loader.num_workers != 0:
        raise NotPlainLoader("its DataLoader uses worker processes (num_workers > 0)")
    if (
        loader.collate_fn is not default_collate
        or loader.batch_size is None
        or type(loader.batch_sampler) is not BatchSampler
    ):
        raise NotPlainLoader("its DataLoader has a custom collate_fn or batch sampler")
    sampler = loader.sampler
    if type(sampler) is RandomSampler:
        if (
            sampler.replacement
            or sampler._num_samples is not None
            or sampler.generator is not loader.generator
        ):
            raise NotPlainLoader(
                "its RandomSampler draws with replacement, a custom number of samples or its own generator"
            )
        shuffle = True
    elif type(sampler) is SequentialSampler:
        shuffle = False
    else:
        raise NotPlainLoader(
            f"its DataLoader samples with {type(sampler).__name__}, not RandomSampler or SequentialSampler"
        )
    dataset, local = _dataset_of(loader)
    return PlainLoader(
        dataset, local, int(loader.batch_size), shuffle, bool(loader.drop_last), loader.generator
    )
