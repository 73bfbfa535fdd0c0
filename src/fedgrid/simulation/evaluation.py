"""The server-side evaluation of a built-in model: its loss and accuracy on the dataset's fixed
test split, in chunks (a language model's: ``lm_task.evaluate_lm``).

``eval_batches`` bounds it: at most that many chunks of ``EVAL_CHUNK`` examples (a language
model's: of ``EVAL_TOKENS`` tokens, whole windows), taken as a fixed random subset of the test
split when it holds more, the same in every round and every run. It gives up between two chunks
once the process is stopping (``fedgrid.interrupts.stopping``: ``InterruptedRunError``)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn

from fedgrid.client.precision import autocast
from fedgrid.client.torch_client import default_device
from fedgrid.errors import InterruptedRunError
from fedgrid.interrupts import stopping
from fedgrid.seeding import RNG_LOCK
from fedgrid.simulation.catalog import build_model, load_data, tokenizer_of
from fedgrid.simulation.datasets import DatasetData
from fedgrid.simulation.lm_task import context_of, evaluate_lm
from fedgrid.types import ModelState

__all__ = ["make_evaluate", "EVAL_CHUNK", "EVAL_TOKENS", "DEFAULT_EVAL_BATCHES"]

#: Test examples per forward pass of the server-side evaluation.
EVAL_CHUNK = 1024
#: A language model's tokens per forward pass of it (whole windows: at least one).
EVAL_TOKENS = 8192
#: ``eval_batches``' default (the config key's).
DEFAULT_EVAL_BATCHES = 4
#: Seed of the fixed subset a bounded evaluation reads.
_SUBSET_SEED = 20_240


def check_stop() -> None:
    """Raises ``InterruptedRunError`` once the process is stopping (between two batches)."""
    if stopping():
        raise InterruptedRunError("the server-side evaluation was given up: the process is stopping")


def bounded_index(index: torch.Tensor | None, n: int, limit: int) -> torch.Tensor | None:
    """At most ``limit`` of the evaluation examples ``index`` (``None``: all ``n``): a fixed random
    subset, in order, when there are more (the same in every run)."""
    total = n if index is None else len(index)
    if total <= limit:
        return index
    pick = np.sort(np.random.default_rng(_SUBSET_SEED).choice(total, limit, replace=False))
    chosen = torch.from_numpy(pick)
    return chosen if index is None else index[chosen]


def make_evaluate(
    dataset: str = "digits",
    model: str = "",
    data_dir: str = "",
    precision: str = "fp32",
    peft: str = "",
    lora_aggregation: str | None = None,
    eval_batches: int = DEFAULT_EVAL_BATCHES,
    text_column: str = "text",
) -> Callable[[ModelState], tuple[float, dict[str, float]]]:
    """The server-side evaluation of a built-in model: mean cross-entropy and accuracy on
    the dataset's fixed test split (``BuiltinDataset.eval_limit``: a fixed subset of it), in chunks of
    ``EVAL_CHUNK`` examples; a language model's: the cross-entropy per token (``loss``),
    ``perplexity`` = ``exp(loss)`` and the token ``accuracy``. Forward passes run at
    ``precision`` (``fedgrid.client.precision``); at most ``eval_batches`` chunks (module docstring).

    Raises:
        ValueError: ``eval_batches`` below 1.
    """
    if eval_batches < 1:
        raise ValueError(f"eval_batches must be at least 1, got {eval_batches}")
    held: list[nn.Module] = []
    context = context_of(model)

    @torch.no_grad()
    def evaluate(state: ModelState) -> tuple[float, dict[str, float]]:
        check_stop()
        data = load_data(dataset, data_dir, context, text_column, tokenizer_of(model))
        if not held:
            with RNG_LOCK, torch.random.fork_rng(devices=[]):
                held.append(
                    build_model(dataset, model, data_dir, peft, lora_aggregation).to(default_device())
                )
        net = held[0]
        net.load_state_dict(state)
        net.eval()
        device = next(net.parameters()).device
        with autocast(device, precision):
            if context:
                chunk = max(1, EVAL_TOKENS // context)
                index = bounded_index(data.eval_index, len(data.y_test), chunk * eval_batches)
                return evaluate_lm(net, data, device, chunk=chunk, index=index, between=check_stop)
            return _evaluate(
                net, data, device, bounded_index(data.eval_index, len(data.y_test), EVAL_CHUNK * eval_batches)
            )

    return evaluate


def _evaluate(
    net: nn.Module, data: DatasetData, device: torch.device, index: torch.Tensor | None
) -> tuple[float, dict[str, float]]:
    """Mean cross-entropy and accuracy of class scores on the evaluation examples ``index`` (``None``: all)."""
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
        check_stop()
        x, y = data.test(
            slice(start, start + EVAL_CHUNK) if index is None else index[start : start + EVAL_CHUNK]
        )
        x, y = x.to(device), y.to(device)
        out = net(x)
        loss_sum += float(nn.functional.cross_entropy(out, y, reduction="sum"))
        correct += int((out.argmax(1) == y).sum())
    return loss_sum / n, {"accuracy": correct / n}
