"""The server-side evaluation of a built-in model: its loss and accuracy on the dataset's fixed
test split, in chunks (a language model's: ``lm_task.evaluate_lm``)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fedgrid.client.precision import autocast
from fedgrid.client.torch_client import default_device
from fedgrid.seeding import RNG_LOCK
from fedgrid.simulation.catalog import build_model, load_data
from fedgrid.simulation.datasets import DatasetData
from fedgrid.simulation.lm_task import context_of, evaluate_lm
from fedgrid.types import ModelState

__all__ = ["make_evaluate", "EVAL_CHUNK"]

#: Test examples per forward pass of the server-side evaluation.
EVAL_CHUNK = 1024


def make_evaluate(
    dataset: str = "digits",
    model: str = "",
    data_dir: str = "",
    precision: str = "fp32",
    peft: str = "",
    lora_aggregation: str | None = None,
) -> Callable[[ModelState], tuple[float, dict[str, float]]]:
    """The server-side evaluation of a built-in model: mean cross-entropy and accuracy on
    the dataset's fixed test split (``BuiltinDataset.eval_limit``: a fixed subset of it), in chunks of
    ``EVAL_CHUNK`` examples; a language model's: the cross-entropy per token (``loss``),
    ``perplexity`` = ``exp(loss)`` and the token ``accuracy``. Forward passes run at
    ``precision`` (``fedgrid.client.precision``)."""
    held: list[nn.Module] = []
    context = context_of(model)

    @torch.no_grad()
    def evaluate(state: ModelState) -> tuple[float, dict[str, float]]:
        data = load_data(dataset, data_dir, context)
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
                return evaluate_lm(net, data, device, chunk=EVAL_CHUNK)
            return _evaluate(net, data, device)

    return evaluate


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
