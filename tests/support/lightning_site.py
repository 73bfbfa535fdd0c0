"""A small ``LightningModule`` (a linear regression) and its factory, ``lightning_site:model``, for
the Lightning callback's test: the coordinator builds it from the factory, the sites train it."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn


class Regression(L.LightningModule):
    """``y = x @ w`` on 4 features, trained with SGD at ``lr``."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def model() -> Regression:
    return Regression()


def site_data(k: int, n: int = 16) -> torch.utils.data.TensorDataset:
    """Site ``k``'s ``n`` examples of ``y = x @ [1, -2, 3, 0.5] + k`` (the sites differ by an offset)."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]]) + k
    return torch.utils.data.TensorDataset(x, y)
