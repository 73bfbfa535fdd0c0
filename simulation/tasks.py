"""Built-in datasets ("tasks"): data, models, a client factory and a server-side evaluation, by name.

| dataset | data | models (default first) | default partition |
|---|---|---|---|
| ``digits`` | scikit-learn's digits, no files | ``mlp``, ``logistic`` | ``dirichlet:0.5`` |
| ``fashion-mnist`` | the four idx.gz files in ``data_dir`` | ``mlp``, ``cnn``, ``logistic`` | ``dirichlet:0.5`` |
| ``shakespeare`` | the LEAF split by speaking role, from ``data_dir`` | ``lstm``, ``gpt``, ``hf:PATH`` | ``natural`` |
| ``synthetic`` | LEAF's Synthetic(1, 1), generated, no files | ``logistic`` | ``natural`` |

The server-side evaluation reports test loss and accuracy on the fixed test split
(Shakespeare: a fixed subset of 2,000 test windows), in chunks.

The language models (``gpt``, ``gpt:SIZES``, ``hf:PATH``; ``fedgrid.simulation.language``)
train on Shakespeare's characters as windows of their context length with every next
character as a target; their evaluation reports ``loss`` in nats per token, ``perplexity``
(``exp(loss)``) and the token ``accuracy``.

A client factory has the signature of ``--app MODULE:FACTORY``:
``factory(partition: int, num_partitions: int, seed: int, **options) -> Client``. The
built-in one, ``builtin_client``, takes the options ``client_options(config)`` lists, so a
``fedgrid client`` process given the same options trains exactly like its simulated twin.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data import Dataset as TorchDataset

from fedgrid.client.api import Client
from fedgrid.client.precision import autocast
from fedgrid.client.torch_client import TorchClient, default_device
from fedgrid.config_groups import PRECISIONS
from fedgrid.errors import ConfigError
from fedgrid.lazy import exports
from fedgrid.plugins import initial_state, is_factory_spec
from fedgrid.seeding import RNG_LOCK
from fedgrid.simulation.datasets import (
    DatasetData,
    load_digits,
    load_fashion_mnist,
    load_synthetic,
    parse_partition,
    partition,
)
from fedgrid.simulation.language import (
    LMSpec,
    build_lm,
    check_lm,
    lm_spec,
    lm_windows,
    next_char_windows,
    token_cross_entropy,
)
from fedgrid.simulation.models import char_lstm, digits_mlp, fmnist_cnn, fmnist_mlp, logistic
from fedgrid.simulation.shakespeare import NextChars
from fedgrid.types import ModelState

if TYPE_CHECKING:
    from fedgrid.config import Config

__all__ = [
    "BuiltinDataset",
    "DATASETS",
    "OPTIMIZERS",
    "CLIENT_KEYS",
    "Resolved",
    "resolve",
    "get_dataset",
    "check_options",
    "check_config",
    "client_options",
    "load_data",
    "DatasetData",
    "build_model",
    "make_evaluate",
    "initial_state",
    "builtin_client",
    "digits_model",
    "digits_client",
    "digits_evaluate",
    "DIGITS_BATCH_SIZE",
]

DIGITS_BATCH_SIZE = 32
OPTIMIZERS = ("sgd", "adam", "adamw")
#: Config keys the built-in client factory takes (``partition`` arrives as ``partitioner``).
CLIENT_KEYS = (
    "dataset",
    "data_dir",
    "partition",
    "model",
    "batch_size",
    "optimizer",
    "lr",
    "momentum",
    "weight_decay",
    "precision",
)
#: Test examples per forward pass of the server-side evaluation.
EVAL_CHUNK = 1024

ModelFactory = Callable[["DatasetData"], nn.Module]


@dataclass(frozen=True)
class BuiltinDataset:
    """A built-in dataset: how to load it, its models, its default partition.

    Attributes:
        models: built-in model name -> factory taking the loaded data; the first is the default.
        needs_data_dir: the data is read from ``data_dir``.
        natural: the data has natural groups (the ``natural`` partition applies).
        eval_limit: the server-side evaluation uses a fixed random subset of this many test
            examples (``None``: all of them).
    """

    name: str
    load: Callable[[str], Any]
    models: Mapping[str, ModelFactory]
    default_partition: str
    needs_data_dir: bool = False
    natural: bool = False
    eval_limit: int | None = None

    @property
    def default_model(self) -> str:
        return next(iter(self.models))


def _load_shakespeare(data_dir: str, context: int = 0) -> Any:
    """LEAF's Shakespeare (``context`` 0), or a language model's windows of ``context`` characters."""
    from fedgrid.simulation.shakespeare import load_shakespeare

    if context:
        return lm_windows(load_shakespeare(data_dir, seq_len=context))
    return load_shakespeare(data_dir)


#: The dataset a language model (``gpt``, ``hf:PATH``) trains on.
LM_DATASET = "shakespeare"


DATASETS: dict[str, BuiltinDataset] = {
    "digits": BuiltinDataset(
        "digits",
        lambda _: load_digits(),
        {"mlp": lambda d: digits_mlp(), "logistic": lambda d: logistic(64, d.num_classes)},
        "dirichlet:0.5",
    ),
    "fashion-mnist": BuiltinDataset(
        "fashion-mnist",
        load_fashion_mnist,
        {
            "mlp": lambda d: fmnist_mlp(d.num_classes),
            "cnn": lambda d: fmnist_cnn(d.num_classes),
            "logistic": lambda d: logistic(784, d.num_classes),
        },
        "dirichlet:0.5",
        needs_data_dir=True,
    ),
    # 2,000 of the 0.36 M test windows (a fixed subset): the LSTM on the whole test split would
    # cost a CPU many minutes per round.
    "shakespeare": BuiltinDataset(
        "shakespeare",
        _load_shakespeare,
        {"lstm": lambda d: char_lstm(d.num_classes)},
        "natural",
        needs_data_dir=True,
        natural=True,
        eval_limit=2_000,
    ),
    "synthetic": BuiltinDataset(
        "synthetic",
        lambda _: load_synthetic(),
        {"logistic": lambda d: logistic(60, d.num_classes)},
        "natural",
        natural=True,
    ),
}


def get_dataset(name: str) -> BuiltinDataset:
    """Returns the built-in dataset ``name``.

    Raises:
        ConfigError: no such dataset (names ``dataset``).
    """
    try:
        return DATASETS[name]
    except KeyError:
        raise ConfigError(
            "dataset", f"unknown dataset {name!r} (known: {', '.join(sorted(DATASETS))})"
        ) from None


def check_config(config: "Config") -> None:
    """Checks the keys of ``config`` that need this layer: dataset, data folder, model,
    partition, optimizer and the heterogeneity keys (reads a trace file, loads no data).

    Raises:
        ConfigError: a bad value, naming its key.
    """
    from fedgrid.simulation.heterogeneity import check_heterogeneity

    check_options(
        dataset=config.dataset,
        data_dir=config.data_dir,
        model=config.model,
        partition=config.partition,
        optimizer=config.optimizer,
    )
    check_heterogeneity(config)


def check_options(
    *, dataset: str, data_dir: str = "", model: str = "", partition: str = "", optimizer: str = "sgd"
) -> None:
    """Checks the data and model options without loading any data.

    Raises:
        ConfigError: unknown dataset, model, partitioner or optimizer; a missing data folder;
            ``natural`` for a dataset without natural groups; a language model's bad size
            string, ``hf:`` folder or vocabulary, or a dataset other than Shakespeare for it.
    """
    from fedgrid.plugins import check_spec

    task = get_dataset(dataset)
    if task.needs_data_dir and not data_dir:
        raise ConfigError("data_dir", f"dataset {dataset} reads its files from --data-dir (see the README)")
    if data_dir and not os.path.isdir(data_dir):
        raise ConfigError("data_dir", f"{data_dir!r} is not a folder")
    if _language_model(dataset, model) is None:  # a language model's spec is checked there
        if ":" in model:
            check_spec(model, key="model")
        elif model and model not in task.models:
            raise ConfigError(
                "model",
                f"unknown model {model!r} for dataset {dataset} (known: {_known_models(dataset)}; or MODULE:FACTORY)",
            )
    name, _ = parse_partition(partition or task.default_partition)
    if name == "natural" and not task.natural:
        natural = ", ".join(n for n, t in DATASETS.items() if t.natural)
        raise ConfigError(
            "partition", f"natural needs a dataset with natural groups ({natural}); {dataset} has none"
        )
    if optimizer not in OPTIMIZERS:
        raise ConfigError("optimizer", f"unknown optimizer {optimizer!r} (known: {', '.join(OPTIMIZERS)})")


def _known_models(dataset: str) -> str:
    names = list(get_dataset(dataset).models)
    return ", ".join(names + (["gpt[:SIZES]", "hf:PATH"] if dataset == LM_DATASET else []))


def _language_model(dataset: str, model: str) -> LMSpec | None:
    """The language model ``model`` names, checked (``None``: not one).

    Raises:
        ConfigError: a bad spec, or a dataset other than Shakespeare (names ``model``).
    """
    spec = lm_spec(model)
    if spec is None:
        return None
    if dataset != LM_DATASET:
        raise ConfigError(
            "model", f"{model} is a language model of Shakespeare's characters: add --dataset {LM_DATASET}"
        )
    check_lm(spec)
    return spec


def _context(model: str) -> int:
    """Characters per example of a language model (0: not one)."""
    spec = lm_spec(model)
    return 0 if spec is None else spec.context


@functools.lru_cache(maxsize=4)
def load_data(dataset: str, data_dir: str = "", context: int = 0) -> DatasetData:
    """The dataset's train/test split, loaded once per process; with ``context``, a language
    model's non-overlapping windows of that many characters (Shakespeare only)."""
    task = get_dataset(dataset)
    try:
        source = _load_shakespeare(data_dir, context) if context else task.load(data_dir)
        return DatasetData(source, eval_limit=task.eval_limit)
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:
        raise ConfigError("data_dir", f"cannot load {dataset} from {data_dir!r}: {exc}") from None


@functools.lru_cache(maxsize=8)
def _parts(
    dataset: str, data_dir: str, num_partitions: int, spec: str, seed: int, context: int = 0
) -> tuple[np.ndarray, ...]:
    # Computed once per process: a simulation building 1,000 clients splits the data once.
    data = load_data(dataset, data_dir, context)
    return tuple(partition(data.y_train.numpy(), num_partitions, spec, seed, groups=data.train_groups))


def build_model(dataset: str = "digits", model: str = "", data_dir: str = "") -> nn.Module:
    """A fresh model: the built-in ``model`` of ``dataset`` (its default when empty), a
    language model (``gpt``, ``gpt:SIZES``, ``hf:PATH``), or the ``MODULE:FACTORY`` user
    model (called with no arguments).

    Raises:
        ConfigError: unknown model, a bad language model spec, or user code that cannot be loaded.
    """
    spec = _language_model(dataset, model)
    if spec is not None:
        return build_lm(spec)
    if ":" in model:
        from fedgrid.plugins import load_object

        return load_object(model, key="model")()
    task = get_dataset(dataset)
    name = model or task.default_model
    if name not in task.models:
        raise ConfigError(
            "model",
            f"unknown model {name!r} for dataset {dataset} (known: {_known_models(dataset)}; or MODULE:FACTORY)",
        )
    return task.models[name](load_data(dataset, data_dir))


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
    model's (``context``) are lazy ``NextChars`` windows: a client's share as int64 tensors
    would take ``2 * context * 8`` bytes per window."""
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
        source = data.source
        return (
            NextChars(source.text, source.train_starts[torch.from_numpy(mine)], context),
            NextChars(source.text, source.test_starts[test_index], context),
        )
    return TensorDataset(*data.train(torch.from_numpy(mine))), TensorDataset(*data.test(test_index))


def builtin_client(
    partition_index: int,
    num_partitions: int,
    seed: int,
    *,
    dataset: str = "digits",
    data_dir: str = "",
    partitioner: str = "",
    model: str = "",
    batch_size: int = DIGITS_BATCH_SIZE,
    optimizer: str = "sgd",
    lr: float = 0.05,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    precision: str = "fp32",
    device: str | None = None,
) -> TorchClient:
    """Client ``partition_index`` of ``num_partitions`` on a built-in dataset.

    It trains with cross-entropy on ``DataLoader(its examples, batch_size, shuffle=True)``
    with ``optimizer`` (``sgd`` with ``momentum`` and ``weight_decay``; ``adam`` and
    ``adamw`` with ``weight_decay``); the task's ``lr`` overrides ``lr``. It evaluates on
    the test examples of its own groups under the ``natural`` partition, else on those of
    the server-side evaluation. A language model (``gpt``, ``hf:PATH``) trains on windows of
    its context with the cross-entropy over every position (``token_cross_entropy``); its
    ``num_examples`` counts windows, each of ``context`` tokens.

    Args:
        partitioner: the partition spec; empty: the dataset's default.
        model: a built-in model name, a language model or ``MODULE:FACTORY``; empty: the
            dataset's default.
        precision: the forward passes' precision (``fedgrid.client.precision``).

    Raises:
        ConfigError: an index outside ``0..num_partitions-1`` or a bad option (names the key).
    """
    if not 0 <= partition_index < num_partitions:
        raise ConfigError("partition", f"index {partition_index} is outside 0..{num_partitions - 1}")
    task = get_dataset(dataset)
    spec = partitioner or task.default_partition
    check_options(dataset=dataset, data_dir=data_dir, model=model, partition=spec, optimizer=optimizer)
    if batch_size < 1:
        raise ConfigError("batch_size", f"must be at least 1, got {batch_size}")
    if precision not in PRECISIONS:
        raise ConfigError("precision", f"unknown precision {precision!r} (known: {', '.join(PRECISIONS)})")
    context = _context(model)
    train, test = _client_data(dataset, data_dir, spec, seed, partition_index, num_partitions, context)
    with RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = build_model(dataset, model, data_dir)  # overwritten by the global model at the first fit
    client = TorchClient(
        net,
        DataLoader(train, batch_size=batch_size, shuffle=True),
        token_cross_entropy if context else nn.functional.cross_entropy,
        _optimizer(optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay),
        eval_loader=DataLoader(test, batch_size=256 if not context else 64),
        device=device,
        seed=seed,
        name=f"{dataset}-{partition_index:04d}/{num_partitions}",
    )
    client.precision = precision
    return client


def client_options(config: "Config") -> dict[str, Any]:
    """The options ``builtin_client`` takes, from ``config`` (``CLIENT_KEYS``)."""
    options = {key: getattr(config, key) for key in CLIENT_KEYS if key != "partition"}
    options["partitioner"] = config.partition
    return options


def make_evaluate(
    dataset: str = "digits", model: str = "", data_dir: str = "", precision: str = "fp32"
) -> Callable[[ModelState], tuple[float, dict[str, float]]]:
    """The server-side evaluation of a built-in model: mean cross-entropy and accuracy on
    the dataset's fixed test split (``BuiltinDataset.eval_limit``: a fixed subset of it), in chunks of
    ``EVAL_CHUNK`` examples; a language model's: the cross-entropy per token (``loss``),
    ``perplexity`` = ``exp(loss)`` and the token ``accuracy``. Forward passes run at
    ``precision`` (``fedgrid.client.precision``)."""
    held: list[nn.Module] = []
    context = _context(model)

    @torch.no_grad()
    def evaluate(state: ModelState) -> tuple[float, dict[str, float]]:
        data = load_data(dataset, data_dir, context)
        if not held:
            with RNG_LOCK, torch.random.fork_rng(devices=[]):
                held.append(build_model(dataset, model, data_dir).to(default_device()))
        net = held[0]
        net.load_state_dict(state)
        net.eval()
        device = next(net.parameters()).device
        with autocast(device, precision):
            if context:
                return _evaluate_lm(net, data, device)
            return _evaluate(net, data, device)

    return evaluate


def _evaluate_lm(net: nn.Module, data: DatasetData, device: torch.device) -> tuple[float, dict[str, float]]:
    """A language model's token cross-entropy, perplexity and token accuracy on its evaluation windows."""
    index = torch.arange(len(data.y_test)) if data.eval_index is None else data.eval_index
    loss_sum, correct, tokens = 0.0, 0, 0
    for start in range(0, len(index), EVAL_CHUNK):
        x, y = next_char_windows(data.source, "test", index[start : start + EVAL_CHUNK])
        x, y = x.to(device), y.to(device)
        out = net(x)
        loss_sum += float(token_cross_entropy(out, y, reduction="sum"))
        correct += int((out.argmax(-1) == y).sum())
        tokens += y.numel()
    loss = loss_sum / max(tokens, 1)
    return loss, {"perplexity": math.exp(loss), "accuracy": correct / max(tokens, 1)}


def _evaluate(net: nn.Module, data: DatasetData, device: torch.device) -> tuple[float, dict[str, float]]:
    """Mean cross-entropy and accuracy of class scores on the evaluation examples."""
    index = data.eval_index
    n = len(data.y_test) if index is None else len(index)
    if n <= EVAL_CHUNK:
        x, y = data.test(slice(None) if index is None else index)
        out = net(x.to(device))
        y = y.to(device)
        return float(nn.functional.cross_entropy(out, y)), {
            "accuracy": float((out.argmax(1) == y).float().mean())
        }
    loss_sum, correct = 0.0, 0
    for start in range(0, n, EVAL_CHUNK):
        x, y = data.test(
            slice(start, start + EVAL_CHUNK) if index is None else index[start : start + EVAL_CHUNK]
        )
        x, y = x.to(device), y.to(device)
        out = net(x)
        loss_sum += float(nn.functional.cross_entropy(out, y, reduction="sum"))
        correct += int((out.argmax(1) == y).sum())
    return loss_sum / n, {"accuracy": correct / n}


@dataclass(frozen=True)
class Resolved:
    """What a run needs from its configuration's dataset, model and app keys."""

    initial_state: ModelState
    evaluate: Callable[[ModelState], tuple[float, dict[str, float]]] | None
    client_factory: Callable[..., Client]


def resolve(
    *,
    dataset: str = "digits",
    model: str = "",
    app: str = "",
    seed: int = 0,
    data_dir: str = "",
    precision: str = "fp32",
) -> Resolved:
    """Builds the initial model and finds the evaluation and client factory.

    A built-in ``model`` name (or none: the dataset's default; or a language model) keeps
    the server-side evaluation on the dataset's test split, run at ``precision``; a
    ``MODULE:FACTORY`` model drops it (it would not fit); a custom ``app`` replaces the
    built-in client factory.

    Raises:
        ConfigError: unknown dataset or model, unreadable data, or user code that cannot be
            loaded or built.
    """
    from fedgrid.plugins import load_object

    get_dataset(dataset)
    custom = is_factory_spec(model)
    if custom:
        load_object(model, key="model")  # a bad spec names the key before the model is built
    try:
        state = initial_state(lambda: build_model(dataset, model, data_dir), seed)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError("model", f"building the model failed: {type(exc).__name__}: {exc}") from None
    client_factory = load_object(app, key="app") if app else builtin_client
    evaluate = None if custom else make_evaluate(dataset, model, data_dir, precision)
    return Resolved(state, evaluate, client_factory)


# The names of the first release: digits' model, client factory (``fedgrid client`` without
# ``--app`` runs it; its options reach every built-in dataset) and evaluation.
digits_model = digits_mlp
digits_client = builtin_client
digits_evaluate = make_evaluate("digits")


#: Old names, for one release: each access warns with a DeprecationWarning naming the new one.
__getattr__, _ = exports(
    __name__,
    {},
    deprecated={
        old: f"{__name__}.{new}"
        for old, new in {
            "Task": "BuiltinDataset",
            "TaskData": "DatasetData",
            "TASKS": "DATASETS",
            "get_task": "get_dataset",
        }.items()
    },
    globals_=globals(),
)
