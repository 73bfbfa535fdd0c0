"""Built-in datasets ("tasks"): data, models, a client factory and a server-side evaluation, by name.

| dataset | data | models (default first) | default partition |
|---|---|---|---|
| ``digits`` | scikit-learn's digits, no files | ``mlp``, ``logistic`` | ``dirichlet:0.5`` |
| ``fashion-mnist`` | the four idx.gz files in ``data_dir`` | ``mlp``, ``cnn``, ``logistic`` | ``dirichlet:0.5`` |
| ``shakespeare`` | the LEAF split by speaking role, from ``data_dir`` | ``lstm``, ``gpt``, ``hf:PATH`` | ``natural`` |
| ``synthetic`` | LEAF's Synthetic(1, 1), generated, no files | ``logistic`` | ``natural`` |
| ``text`` | the ``*.txt`` files in ``data_dir``, tokenized | ``gpt``, ``hf:PATH`` (no default) | ``iid`` |
| ``hf:PATH`` | your local rows' ``text_column``, tokenized (``hf_data.load_text``) | ``gpt``, ``hf:PATH`` (no default) | ``iid`` |

The server-side evaluation reports test loss and accuracy on the fixed test split
(Shakespeare: a fixed subset of 2,000 test windows), in chunks.

The language models (``gpt``, ``gpt:SIZES``, ``hf:PATH``; ``fedgrid.simulation.language``)
train on Shakespeare's characters as windows of their context length with every next
character as a target; their evaluation reports ``loss`` in nats per token, ``perplexity``
(``exp(loss)``) and the token ``accuracy``.

A client factory has the signature of ``--app MODULE:FACTORY``:
``factory(partition: int, num_partitions: int, seed: int, **options) -> Client``. The
built-in one, ``builtin_client``, takes one option, ``options``: the ``ClientOptions`` that
``client_options(config)`` reads, so a ``fedgrid client`` process given the same options trains
exactly like its simulated twin.

This module resolves what a run needs from its dataset, model and app keys (``resolve``) and
re-exports the names of the modules that hold the parts: ``fedgrid.simulation.catalog`` (the
datasets, their models and the checks of the options), ``fedgrid.simulation.lm_task`` (the
language-model task), ``fedgrid.simulation.client_factory`` (``builtin_client``) and
``fedgrid.simulation.evaluation`` (``make_evaluate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fedgrid.client.api import Client
from fedgrid.errors import ConfigError
from fedgrid.plugins import initial_state, is_factory_spec
from fedgrid.simulation.catalog import (
    DATASETS,
    OPTIMIZERS,
    BuiltinDataset,
    build_model,
    check_config,
    check_options,
    get_dataset,
    load_data,
)
from fedgrid.simulation.catalog import ModelFactory as ModelFactory
from fedgrid.simulation.client_factory import (
    CLIENT_KEYS,
    DIGITS_BATCH_SIZE,
    ClientOptions,
    builtin_client,
    client_options,
)
from fedgrid.simulation.datasets import DatasetData
from fedgrid.simulation.evaluation import DEFAULT_EVAL_BATCHES, make_evaluate
from fedgrid.simulation.evaluation import EVAL_CHUNK as EVAL_CHUNK
from fedgrid.simulation.lm_task import LM_DATASET as LM_DATASET
from fedgrid.types import ModelState

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
    "ClientOptions",
    "load_data",
    "DatasetData",
    "build_model",
    "make_evaluate",
    "initial_state",
    "builtin_client",
    "DIGITS_BATCH_SIZE",
]


@dataclass(frozen=True)
class Resolved:
    """What a run needs from its configuration's dataset, model and app keys."""

    initial_state: ModelState
    evaluate: Callable[[ModelState], tuple[float, dict[str, float]]] | None
    client_factory: Callable[..., Client]
    #: The frozen base's hash of an adapter model (``--peft``; clients show theirs at Join), else "".
    base_hash: str = ""


def sites_bring_the_data(dataset: str, model: str) -> bool:
    """Whether a coordinator of ``model`` serves a run whose sites bring their own data: a Hugging
    Face model (``hf:PATH``) with a dataset other than the language models' built-in ones (the
    default ``digits``, or ``hf:PATH`` data at the sites). Such a coordinator builds the model
    alone (``site_data_model``) and evaluates nothing on its side."""
    from fedgrid.simulation.language import lm_spec
    from fedgrid.simulation.lm_task import LM_DATASETS

    spec = lm_spec(model)
    return spec is not None and spec.kind == "hf" and dataset not in LM_DATASETS


def site_data_model(
    *, model: str, seed: int = 0, peft: str = "", lora_aggregation: str | None = None
) -> Resolved:
    """The initial model of a coordinator whose sites bring the data (``sites_bring_the_data``):
    the ``hf:PATH`` model (with ``peft``, its adapters and the frozen base's hash), no
    server-side evaluation, and no bound on its vocabulary (the sites' tokenizer decides).

    Raises:
        ConfigError: a missing folder or ``config.json``, ``transformers`` or ``peft`` not
            installed, or a bad ``peft`` spec (names the key).
    """
    from fedgrid.simulation.language import build_lm, lm_spec
    from fedgrid.simulation.peft_lm import build_peft_lm

    spec = lm_spec(model)
    assert spec is not None and spec.kind == "hf"
    built: list[Any] = []

    def build() -> Any:
        net = (
            build_peft_lm(spec.path, peft, frozen_a=lora_aggregation == "ffa", vocab=1)
            if peft
            else build_lm(spec, vocab=1)
        )
        built.append(net)
        return net

    try:
        state = initial_state(build, seed)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError("model", f"building the model failed: {type(exc).__name__}: {exc}") from None
    return Resolved(state, None, builtin_client, getattr(built[0], "base_hash", ""))


def resolve(
    *,
    dataset: str = "digits",
    model: str = "",
    app: str = "",
    seed: int = 0,
    data_dir: str = "",
    precision: str = "fp32",
    peft: str = "",
    lora_aggregation: str | None = None,
    eval_batches: int = DEFAULT_EVAL_BATCHES,
    text_column: str = "text",
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
    built: list[Any] = []

    def build() -> Any:
        built.append(build_model(dataset, model, data_dir, peft, lora_aggregation))
        return built[-1]

    try:
        state = initial_state(build, seed)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError("model", f"building the model failed: {type(exc).__name__}: {exc}") from None
    client_factory = load_object(app, key="app") if app else builtin_client
    evaluate = (
        None
        if custom
        else make_evaluate(
            dataset, model, data_dir, precision, peft, lora_aggregation, eval_batches, text_column
        )
    )
    return Resolved(state, evaluate, client_factory, getattr(built[0], "base_hash", ""))
