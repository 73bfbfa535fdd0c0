"""The built-in client factory: a ``TorchClient`` on its partition of a built-in dataset.

A client factory has the signature of ``--app MODULE:FACTORY``:
``factory(partition: int, num_partitions: int, seed: int, **options) -> Client``. The
built-in one, ``builtin_client``, takes one option, ``options``: the ``ClientOptions`` that
``client_options(config)`` reads, so a ``fedgrid client`` process given the same options trains
exactly like its simulated twin.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data import Dataset as TorchDataset

from fedgrid.client.torch_client import TorchClient
from fedgrid.config_groups import PRECISIONS
from fedgrid.config_llm import peft_at_rank
from fedgrid.errors import ConfigError
from fedgrid.seeding import RNG_LOCK
from fedgrid.simulation.catalog import (
    OPTIMIZERS,
    build_model,
    check_options,
    get_dataset,
    load_data,
    tokenizer_of,
)
from fedgrid.simulation.causal_lm import AccumulatingClient, enable_checkpointing
from fedgrid.simulation.datasets import parse_partition, partition
from fedgrid.simulation.hf_data import HFPartition, is_hf_data, load_text, site_windows
from fedgrid.simulation.language import token_cross_entropy
from fedgrid.simulation.lm_task import context_of, window_datasets

if TYPE_CHECKING:
    from fedgrid.config import Config

__all__ = ["builtin_client", "ClientOptions", "client_options", "CLIENT_KEYS", "DIGITS_BATCH_SIZE"]

DIGITS_BATCH_SIZE = 32
#: Config keys the built-in client factory takes (``partition`` arrives as ``partitioner``).
CLIENT_KEYS = (
    "dataset",
    "data_dir",
    "text_column",
    "label_column",
    "partition",
    "model",
    "batch_size",
    "optimizer",
    "lr",
    "momentum",
    "weight_decay",
    "precision",
    "peft",
    "peft_rank",
    "lora_aggregation",
    "grad_accum",
    "grad_checkpointing",
)


@dataclass(frozen=True)
class ClientOptions:
    """What the built-in client trains on and how (``builtin_client``; the config keys ``CLIENT_KEYS``).

    It trains with cross-entropy on ``DataLoader(its examples, batch_size, shuffle=True)`` with
    ``optimizer`` (``sgd``, ``adam``, ``adamw``); the task's ``lr`` overrides ``lr``.

    Attributes:
        dataset, data_dir: a built-in dataset and where its files are, or ``hf:PATH`` data.
        text_column, label_column: ``hf:PATH`` data's text column(s) and label column.
        partitioner: the partition spec (config key ``partition``); empty: the dataset's default.
        model: a built-in model name, a language model or ``MODULE:FACTORY``; empty: the
            dataset's default.
        batch_size, optimizer, lr, momentum, weight_decay: the local training's.
        precision: the forward passes' precision (``fedgrid.client.precision``).
        peft, peft_rank, lora_aggregation: adapters on an ``hf:PATH`` model at the client's own
            rank (``simulation.peft_lm``) and how the coordinator merges them.
        grad_accum, grad_checkpointing: micro-batches per step, activation checkpointing.
        device: where it trains (``None``: the accelerator if there is one).
    """

    dataset: str = "digits"
    data_dir: str = ""
    text_column: str = "text"
    label_column: str = ""
    partitioner: str = ""
    model: str = ""
    batch_size: int = DIGITS_BATCH_SIZE
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    precision: str = "fp32"
    peft: str = ""
    peft_rank: str = ""
    lora_aggregation: str | None = None
    grad_accum: int = 1
    grad_checkpointing: bool = False
    device: str | None = None


@functools.lru_cache(maxsize=8)
def _parts(
    dataset: str, data_dir: str, num_partitions: int, spec: str, seed: int, context: int = 0
) -> tuple[np.ndarray, ...]:
    # Computed once per process: a simulation building 1,000 clients splits the data once.
    data = load_data(dataset, data_dir, context)
    return tuple(partition(data.y_train.numpy(), num_partitions, spec, seed, groups=data.train_groups))


def _optimizer(
    name: str, *, lr: float, momentum: float, weight_decay: float
) -> Callable[..., torch.optim.Optimizer]:
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ConfigError("optimizer", f"unknown optimizer {name!r} (known: {', '.join(OPTIMIZERS)})")


def _client_data(
    dataset: str,
    data_dir: str,
    spec: str,
    seed: int,
    partition_index: int,
    num_partitions: int,
    context: int = 0,
) -> tuple[TorchDataset, TorchDataset]:
    """``builtin_client``'s training examples (its partition) and test examples (those of its own
    groups under the ``natural`` partition, else the server-side evaluation's). A language
    model's (``context``) are lazy ``NextChars`` windows (``lm_task.window_datasets``)."""
    data = load_data(dataset, data_dir, context)
    mine = _parts(dataset, data_dir, num_partitions, spec, seed, context)[partition_index]
    if (
        parse_partition(spec)[0] == "natural"
        and data.train_groups is not None
        and data.test_groups is not None
    ):
        test_index: torch.Tensor | slice = torch.from_numpy(
            np.flatnonzero(np.isin(data.test_groups, data.train_groups[mine]))
        )
    else:  # the server's test examples (views of one tensor, except Shakespeare's subset)
        test_index = slice(None) if data.eval_index is None else data.eval_index
    if context:
        return window_datasets(data.source, torch.from_numpy(mine), test_index, context)
    return TensorDataset(*data.train(torch.from_numpy(mine))), TensorDataset(*data.test(test_index))


def _check_training_options(batch_size: int, precision: str) -> None:
    """Checks the batch size and the forward passes' precision of ``builtin_client``.

    Raises:
        ConfigError: a batch size under 1 or an unknown precision (names the key).
    """
    if batch_size < 1:
        raise ConfigError("batch_size", f"must be at least 1, got {batch_size}")
    if precision not in PRECISIONS:
        raise ConfigError("precision", f"unknown precision {precision!r} (known: {', '.join(PRECISIONS)})")


def _seeded_model(
    seed: int, dataset: str, model: str, data_dir: str, peft: str = "", lora_aggregation: str | None = None
) -> nn.Module:
    """The client's model, built under ``seed`` without touching the global RNG (the global
    model overwrites its values at the first fit; an adapter model's frozen base is built
    under its own fixed seed, the same in every process)."""
    with RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(dataset, model, data_dir, peft, lora_aggregation)


def builtin_client(
    partition_index: int, num_partitions: int, seed: int, options: ClientOptions = ClientOptions()
) -> TorchClient:
    """Client ``partition_index`` of ``num_partitions`` on a built-in dataset, trained as ``options`` say.

    It evaluates on the test examples of its own groups under the ``natural`` partition, else on
    those of the server-side evaluation. A language model (``gpt``, ``hf:PATH``) trains on
    windows of its context, cross-entropy over every position; ``num_examples`` counts windows.

    Raises:
        ConfigError: an index outside ``0..num_partitions-1`` or a bad option (names the key).
    """
    o = options
    spec = _checked(partition_index, num_partitions, o)
    _check_training_options(o.batch_size, o.precision)
    context = context_of(o.model)
    if is_hf_data(o.dataset):
        train, test = _hf_data(o, spec, seed, partition_index, num_partitions, context)
    else:
        train, test = _client_data(
            o.dataset, o.data_dir, spec, seed, partition_index, num_partitions, context
        )
    peft = peft_at_rank(o.peft, o.peft_rank, partition_index)  # ffa (lora_aggregation): A frozen
    net = _seeded_model(seed, o.dataset, o.model, o.data_dir, peft, o.lora_aggregation)
    if o.grad_checkpointing:
        enable_checkpointing(net)
    client = (AccumulatingClient if o.grad_accum > 1 else TorchClient)(
        net,
        DataLoader(train, batch_size=o.batch_size, shuffle=True),
        token_cross_entropy if context else nn.functional.cross_entropy,
        _optimizer(o.optimizer, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay),
        eval_loader=DataLoader(test, batch_size=256 if not context else 64),
        device=o.device,
        seed=seed,
        name=f"{_short(o.dataset)}-{partition_index:04d}/{num_partitions}",
    )
    return _with_options(client, o.precision, o.grad_accum)


def _short(dataset: str) -> str:
    """A client's name for its dataset: ``hf:`` data by its file or folder name, not its whole path."""
    return "hf:" + dataset.rstrip("/").rsplit("/", 1)[-1] if is_hf_data(dataset) else dataset


def _hf_data(
    o: ClientOptions, spec: str, seed: int, index: int, partitions: int, context: int
) -> tuple[TorchDataset, TorchDataset]:
    """A client's windows of ``hf:PATH`` text: those starting in its rows (``hf_data.site_windows``)."""
    text = load_text(o.dataset, context, o.text_column, tokenizer_of(o.model))
    part = HFPartition.parse(spec, label_column=o.label_column)
    train, test = site_windows(text, part, partitions, index, seed)
    if not len(train):
        raise ConfigError(
            "partition",
            f"site {index} of {partitions} holds no training window of {context} tokens of {o.dataset} "
            f"({len(text.train_rows)} windows in all): fewer sites, or more text",
        )
    return window_datasets(text.chars, torch.from_numpy(train), torch.from_numpy(test), context)


def _checked(index: int, partitions: int, o: ClientOptions) -> str:
    """The partition spec (``partitioner`` or the dataset's default), the options checked."""
    if not 0 <= index < partitions:
        raise ConfigError("partition", f"index {index} is outside 0..{partitions - 1}")
    spec = o.partitioner or get_dataset(o.dataset).default_partition
    check_options(
        dataset=o.dataset,
        data_dir=o.data_dir,
        model=o.model,
        partition=spec,
        optimizer=o.optimizer,
        text_column=o.text_column,
        label_column=o.label_column,
    )
    return spec


def _with_options(client: TorchClient, precision: str, grad_accum: int) -> TorchClient:
    """``client`` with its forward passes' precision and, accumulating, its micro-batches."""
    client.precision = precision
    if isinstance(client, AccumulatingClient):
        client.grad_accum = grad_accum
    return client


def client_options(config: "Config") -> ClientOptions:
    """The options ``builtin_client`` takes, from ``config`` (``CLIENT_KEYS``)."""
    options = {key: getattr(config, key) for key in CLIENT_KEYS if key != "partition"}
    return ClientOptions(partitioner=config.partition, **options)
