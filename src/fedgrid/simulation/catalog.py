"""The built-in datasets by name: how each loads, its models, its default partition, and the
checks of the options that name them (dataset, data folder, model, partition, optimizer).

``fedgrid.simulation.tasks`` documents the table of datasets and re-exports these names.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from torch import nn

from fedgrid.errors import ConfigError
from fedgrid.simulation.datasets import (
    DatasetData,
    load_digits,
    load_fashion_mnist,
    load_synthetic,
    parse_partition,
)
from fedgrid.simulation.hf_data import HFPartition, is_hf_data
from fedgrid.simulation.language import build_lm, lm_spec
from fedgrid.simulation.lm_task import LM_DATASETS, language_model, load_windows
from fedgrid.simulation.models import char_lstm, digits_mlp, fmnist_cnn, fmnist_mlp, logistic
from fedgrid.simulation.shakespeare import VOCAB

if TYPE_CHECKING:
    from fedgrid.config import Config

__all__ = [
    "BuiltinDataset",
    "DATASETS",
    "OPTIMIZERS",
    "get_dataset",
    "check_config",
    "check_options",
    "load_data",
    "build_model",
    "HF_DATASET",
    "tokenizer_of",
]

OPTIMIZERS = ("sgd", "adam", "adamw")

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
        return next(iter(self.models), "")


def _load_shakespeare(data_dir: str, context: int = 0) -> Any:
    """LEAF's Shakespeare (``context`` 0), or a language model's windows of ``context`` characters."""
    from fedgrid.simulation.shakespeare import load_shakespeare

    if context:
        return load_windows(data_dir, context)
    return load_shakespeare(data_dir)


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
    # The *.txt files of data_dir as tokens, for --model hf:PATH or gpt (fedgrid.simulation.causal_lm).
    "text": BuiltinDataset(
        "text",
        lambda data_dir: _no_text_model(),
        {},
        "iid",
        needs_data_dir=True,
        natural=True,
    ),
    "synthetic": BuiltinDataset(
        "synthetic",
        lambda _: load_synthetic(),
        {"logistic": lambda d: logistic(60, d.num_classes)},
        "natural",
        natural=True,
    ),
}


def _no_text_model() -> Any:
    raise ConfigError("model", "dataset text trains a language model: give --model hf:PATH (or gpt)")


def _no_hf_model(data_dir: str) -> Any:
    raise ConfigError(
        "model",
        "hf:PATH data trains a causal language model on its text column: give --model hf:PATH "
        "(a local Hugging Face causal LM folder) or gpt",
    )


#: ``hf:PATH``, a user's own data (``fedgrid.simulation.hf_data``): the text of its rows for a
#: language model, rows partitioned among sites; its evaluation a fixed subset of the test windows.
HF_DATASET = BuiltinDataset("hf:PATH", _no_hf_model, {}, "iid", natural=True, eval_limit=2_000)


def get_dataset(name: str) -> BuiltinDataset:
    """Returns the built-in dataset ``name`` (``HF_DATASET`` for ``hf:PATH``).

    Raises:
        ConfigError: no such dataset (names ``dataset``).
    """
    if is_hf_data(name):
        return HF_DATASET
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
        text_column=config.text_column,
        label_column=config.label_column,
    )
    check_heterogeneity(config)


def check_options(
    *,
    dataset: str,
    data_dir: str = "",
    model: str = "",
    partition: str = "",
    optimizer: str = "sgd",
    text_column: str = "text",
    label_column: str = "",
) -> None:
    """Checks the data and model options without loading any data (``hf:PATH`` data: its rows
    are read, to check the columns the options name).

    Raises:
        ConfigError: unknown dataset, model, partitioner or optimizer; a missing data folder;
            ``natural`` for a dataset without natural groups; a language model's bad size
            string, ``hf:`` folder or vocabulary, or a dataset other than Shakespeare for it;
            ``hf:PATH`` data that is not a local path, a model that is not a language model,
            a partition that does not parse or a column the data lacks (named, with those it has).
    """
    from fedgrid.plugins import check_spec

    if is_hf_data(dataset):
        _check_hf(dataset, model, partition, optimizer, text_column, label_column)
        return
    task = get_dataset(dataset)
    if task.needs_data_dir and not data_dir:
        raise ConfigError("data_dir", f"dataset {dataset} reads its files from --data-dir (see the README)")
    if data_dir and not os.path.isdir(data_dir):
        raise ConfigError("data_dir", f"{data_dir!r} is not a folder")
    if language_model(dataset, model) is None:  # a language model's spec is checked there
        if dataset == "text":
            _no_text_model()
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


def _check_hf(
    dataset: str, model: str, partition: str, optimizer: str, text_column: str, label_column: str
) -> None:
    from fedgrid.simulation.hf_data import check_columns, load_local, text_columns

    part = HFPartition.parse(partition or "iid", label_column=label_column)
    if language_model(dataset, model) is None:
        _no_hf_model("")
    if optimizer not in OPTIMIZERS:
        raise ConfigError("optimizer", f"unknown optimizer {optimizer!r} (known: {', '.join(OPTIMIZERS)})")
    rows = load_local(dataset)
    if not text_columns(text_column):
        raise ConfigError("text_column", "name the text column (or columns, comma-separated)")
    check_columns(rows, text_columns(text_column), "text_column")
    if part.column:
        check_columns(rows, [part.column], "label_column" if part.spec != "natural" else "partition")


def tokenizer_of(model: str) -> str:
    """The folder whose tokenizer cuts ``hf:PATH`` text for ``model``: an ``hf:PATH`` model's own
    (bytes when it holds none), ``""`` (bytes) for ``gpt``."""
    spec = lm_spec(model)
    return spec.path if spec is not None and spec.kind == "hf" else ""


def _known_models(dataset: str) -> str:
    names = list(get_dataset(dataset).models)
    return ", ".join(names + (["gpt[:SIZES]", "hf:PATH"] if dataset in LM_DATASETS else []))


@functools.lru_cache(maxsize=4)
def load_data(
    dataset: str, data_dir: str = "", context: int = 0, text_column: str = "text", tokenizer: str = ""
) -> DatasetData:
    """The dataset's train/test split, loaded once per process; with ``context``, a language
    model's non-overlapping windows of that many characters (Shakespeare), or tokens (``text``;
    ``hf:PATH``: its ``text_column`` cut by the ``tokenizer`` folder's tokenizer, ``hf_data.load_text``)."""
    task = get_dataset(dataset)
    if is_hf_data(dataset):
        from fedgrid.simulation.hf_data import load_text

        if not context:
            _no_hf_model("")
        return DatasetData(
            load_text(dataset, context, text_column, tokenizer).chars, eval_limit=task.eval_limit
        )
    try:
        if context and dataset == "text":
            from fedgrid.simulation.causal_lm import load_text_windows

            source = load_text_windows(data_dir, context)
        else:
            source = _load_shakespeare(data_dir, context) if context else task.load(data_dir)
        return DatasetData(source, eval_limit=task.eval_limit)
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:
        raise ConfigError("data_dir", f"cannot load {dataset} from {data_dir!r}: {exc}") from None


def build_model(
    dataset: str = "digits",
    model: str = "",
    data_dir: str = "",
    peft: str = "",
    lora_aggregation: str | None = None,
) -> nn.Module:
    """A fresh model: the built-in ``model`` of ``dataset`` (its default when empty), a
    language model (``gpt``, ``gpt:SIZES``, ``hf:PATH``; with ``peft``, its adapters over its
    frozen base: ``fedgrid.simulation.peft_lm``, A frozen when ``lora_aggregation`` is ``ffa``),
    or the ``MODULE:FACTORY`` user model (called with no arguments).

    Raises:
        ConfigError: unknown model, a bad language model spec, or user code that cannot be loaded.
    """
    spec = language_model(dataset, model)
    vocab = len(VOCAB)  # Shakespeare's characters
    if spec is not None and dataset == "text":
        from fedgrid.simulation.causal_lm import text_vocab

        vocab = text_vocab(data_dir)
    if spec is not None and is_hf_data(dataset):  # the model folder's tokenizer, or bytes
        from fedgrid.simulation.causal_lm import text_vocab

        vocab = text_vocab(tokenizer_of(model)) if tokenizer_of(model) else 256
    if spec is not None and peft:
        from fedgrid.simulation.peft_lm import build_peft_lm

        return build_peft_lm(spec.path, peft, frozen_a=lora_aggregation == "ffa", vocab=vocab)
    if spec is not None:
        return build_lm(spec, vocab)
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
