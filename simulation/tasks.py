"""Built-in tasks: a model, a client factory and a server-side evaluation, by name.

A client factory has the signature of ``--app MODULE:FACTORY``:
``factory(partition: int, num_partitions: int, seed: int) -> Client``.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid.client.api import Client
from fedgrid.client.torch_client import TorchClient
from fedgrid.errors import ConfigError
from fedgrid.simulation.datasets import load_digits, partition
from fedgrid.types import ModelState

__all__ = ["Task", "TASKS", "Resolved", "resolve", "get_task", "initial_state", "digits_model", "digits_client", "digits_evaluate", "DIGITS_BATCH_SIZE"]

DIGITS_BATCH_SIZE = 32
DIGITS_PARTITION = "dirichlet:0.5"


@dataclass(frozen=True)
class Task:
    """A named task: how to build the model, a client, and evaluate centrally."""

    name: str
    model: Callable[[], nn.Module]
    client: Callable[..., Client]
    evaluate: Callable[[ModelState], tuple[float, dict[str, float]]] | None


def digits_model() -> nn.Module:
    """A small MLP for 8x8 digits (64 -> 64 -> 10)."""
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


@functools.lru_cache(maxsize=1)
def _digits():
    return load_digits()


def digits_client(
    partition_index: int,
    num_partitions: int,
    seed: int,
    *,
    partitioner: str = DIGITS_PARTITION,
    batch_size: int = DIGITS_BATCH_SIZE,
    momentum: float = 0.9,
    device: str | None = None,
) -> TorchClient:
    """Client ``partition_index`` of ``num_partitions`` on digits, non-IID by default."""
    if not 0 <= partition_index < num_partitions:
        raise ConfigError("partition", f"index {partition_index} is outside 0..{num_partitions - 1}")
    data = _digits()
    parts = partition(data.y_train.numpy(), num_partitions, partitioner, seed)
    idx = torch.from_numpy(parts[partition_index])
    train = TensorDataset(data.x_train[idx], data.y_train[idx])
    test = TensorDataset(data.x_test, data.y_test)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = digits_model()  # overwritten by the global model at the first fit
    return TorchClient(
        model,
        DataLoader(train, batch_size=batch_size, shuffle=True),
        nn.functional.cross_entropy,
        lambda params: torch.optim.SGD(params, lr=0.05, momentum=momentum),
        eval_loader=DataLoader(test, batch_size=256),
        device=device,
        seed=seed,
        name=f"digits-{partition_index:04d}/{num_partitions}",
    )


@torch.no_grad()
def digits_evaluate(state: ModelState) -> tuple[float, dict[str, float]]:
    """Test loss and accuracy of ``state`` on the fixed digits test split."""
    data = _digits()
    model = digits_model()
    model.load_state_dict(state)
    model.eval()
    out = model(data.x_test)
    loss = float(nn.functional.cross_entropy(out, data.y_test))
    acc = float((out.argmax(1) == data.y_test).float().mean())
    return loss, {"accuracy": acc}


def initial_state(model_factory: Callable[[], nn.Module], seed: int) -> ModelState:
    """The model initialized from ``seed`` (identical in every process)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_factory()
    return OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())


@dataclass(frozen=True)
class Resolved:
    """What a run needs from its configuration's task, model and app keys."""

    initial_state: ModelState
    evaluate: Callable[[ModelState], tuple[float, dict[str, float]]] | None
    client_factory: Callable[..., Client]


def resolve(*, task: str, model: str = "", app: str = "", seed: int = 0) -> Resolved:
    """Builds the initial model and finds the evaluation and client factory.

    A custom ``model`` replaces the task's model and drops its server-side evaluation (it
    would not fit); a custom ``app`` replaces the task's client factory.

    Raises:
        ConfigError: unknown task, or user code that cannot be loaded or built.
    """
    from fedgrid.plugins import load_object

    base = get_task(task)
    factory = load_object(model, key="model") if model else base.model
    try:
        state = initial_state(factory, seed)
    except Exception as exc:
        raise ConfigError("model", f"building the model failed: {type(exc).__name__}: {exc}") from None
    client_factory = load_object(app, key="app") if app else base.client
    return Resolved(state, None if model else base.evaluate, client_factory)


TASKS: dict[str, Task] = {
    "digits": Task("digits", digits_model, digits_client, digits_evaluate),
}


def get_task(name: str) -> Task:
    """Returns the built-in task ``name``.

    Raises:
        ConfigError: no such task.
    """
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError("task", f"unknown task {name!r} (known: {', '.join(sorted(TASKS))})") from None
