"""The language-model task: Shakespeare's characters as windows of a language model's context.

A language model (``gpt``, ``gpt:SIZES``, ``hf:PATH``; ``fedgrid.simulation.language``) trains
on Shakespeare only, on non-overlapping windows of its context length with every next character
as a target; a client's windows are lazy ``NextChars`` views of the text. Its evaluation reports
``loss`` in nats per token, ``perplexity`` (``exp(loss)``) and the token ``accuracy``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from fedgrid.errors import ConfigError
from fedgrid.simulation.datasets import DatasetData
from fedgrid.simulation.language import (
    LMSpec,
    check_lm,
    lm_spec,
    lm_windows,
    next_char_windows,
    token_cross_entropy,
)
from fedgrid.simulation.shakespeare import NextChars

__all__ = ["LM_DATASET", "load_windows", "language_model", "context_of", "window_datasets", "evaluate_lm"]

#: The dataset a language model (``gpt``, ``hf:PATH``) trains on.
LM_DATASET = "shakespeare"
#: The datasets a language model trains on: Shakespeare's characters, or ``text``: the tokens of
#: the ``*.txt`` files of ``data_dir`` (``fedgrid.simulation.causal_lm.load_text_windows``).
LM_DATASETS = (LM_DATASET, "text")


def load_windows(data_dir: str, context: int) -> Any:
    """Shakespeare's characters from ``data_dir`` as a language model's windows of ``context`` characters."""
    from fedgrid.simulation.shakespeare import load_shakespeare

    return lm_windows(load_shakespeare(data_dir, seq_len=context))


def language_model(dataset: str, model: str) -> LMSpec | None:
    """The language model ``model`` names, checked (``None``: not one).

    Raises:
        ConfigError: a bad spec, or a dataset other than Shakespeare (names ``model``).
    """
    spec = lm_spec(model)
    if spec is None:
        return None
    if dataset not in LM_DATASETS and not dataset.startswith("hf:"):  # hf:PATH: a user's text
        raise ConfigError(
            "model",
            f"{model} is a language model of Shakespeare's characters or of text files: add --dataset "
            f"{LM_DATASET}, --dataset text or --dataset hf:PATH",
        )
    check_lm(spec)
    return spec


def context_of(model: str) -> int:
    """Characters per example of a language model (0: not one)."""
    spec = lm_spec(model)
    return 0 if spec is None else spec.context


def window_datasets(
    source: Any, train: torch.Tensor, test: torch.Tensor | slice, context: int
) -> tuple[NextChars, NextChars]:
    """A client's training windows (the ``train`` starts) and test windows (the ``test`` ones),
    lazy: its share as int64 tensors would take ``2 * context * 8`` bytes per window."""
    return (
        NextChars(source.text, source.train_starts[train], context),
        NextChars(source.text, source.test_starts[test], context),
    )


def evaluate_lm(
    net: nn.Module,
    data: DatasetData,
    device: torch.device,
    *,
    chunk: int,
    index: torch.Tensor | None = None,
    between: Callable[[], None] | None = None,
) -> tuple[float, dict[str, float]]:
    """A language model's token cross-entropy, perplexity and token accuracy on its evaluation
    windows (``index``; default: ``data.eval_index``, or all), ``chunk`` windows per forward
    pass; ``between`` runs before each (a stop check that raises)."""
    if index is None:
        index = torch.arange(len(data.y_test)) if data.eval_index is None else data.eval_index
    loss_sum, correct, tokens = 0.0, 0, 0
    for start in range(0, len(index), chunk):
        if between is not None:
            between()
        x, y = next_char_windows(data.source, "test", index[start : start + chunk])
        x, y = x.to(device), y.to(device)
        out = net(x)
        loss_sum += float(token_cross_entropy(out, y, reduction="sum"))
        correct += int((out.argmax(-1) == y).sum())
        tokens += y.numel()
    loss = loss_sum / max(tokens, 1)
    return loss, {"perplexity": math.exp(loss), "accuracy": correct / max(tokens, 1)}
