"""A user app for tests: linear regression on synthetic data, no server-side evaluation.

``model()`` is the coordinator's ``--model``; ``client(partition, num_partitions, seed)``
is the client's ``--app``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid.client import TorchClient

TRUE_W = torch.tensor([[2.0, -3.0, 0.5]])


def model() -> nn.Module:
    return nn.Linear(3, 1)


def client(partition: int, num_partitions: int, seed: int) -> TorchClient:
    g = torch.Generator().manual_seed(seed * 1000 + partition)
    n = 40 + 20 * partition  # unequal sizes, so weighting matters
    x = torch.randn(n, 3, generator=g)
    y = x @ TRUE_W.T + 1.0 + 0.01 * torch.randn(n, 1, generator=g)
    data = TensorDataset(x, y)
    return TorchClient(
        model(),
        DataLoader(data, batch_size=8, shuffle=True),
        nn.functional.mse_loss,
        lambda params: torch.optim.SGD(params, lr=0.05),
        eval_loader=DataLoader(data, batch_size=64),
        device="cpu",
        seed=seed,
        name=f"linear-{partition}/{num_partitions}",
    )


class NoEval(TorchClient):
    def evaluate(self, state, config):
        raise NotImplementedError("this client keeps no evaluation data")


def client_without_eval(partition: int, num_partitions: int, seed: int) -> TorchClient:
    c = client(partition, num_partitions, seed)
    c.__class__ = NoEval
    return c
