"""The client half of block-coordinate rounds (``bcd``, ``fedgrid.aggregation.bcd``): only the
task's block of the model trains, with optimizer state for it alone, and only it is sent."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch
from torch import nn

from fedgrid.client.algorithm_hooks import ClientAlgorithm, FitContext, Trainer
from fedgrid.client.algorithm_math import names_under
from fedgrid.types import ModelState

__all__ = ["BlockCoordinateTraining"]


class BlockCoordinateTraining(ClientAlgorithm):
    """``bcd``: only the ``block_prefixes`` tensors train, with optimizer state for them alone, and are sent."""

    name = "bcd"

    def trained(self, *, names: Sequence[str], ctx: FitContext) -> list[str]:
        return names_under(names, str(ctx.config.get("block_prefixes", "")), key="block_prefixes")

    def optimizer(
        self, *, trainer: Trainer, params: Sequence[nn.Parameter], ctx: FitContext
    ) -> torch.optim.Optimizer:
        return trainer.optimizer_factory(params)

    def upload(self, *, state: ModelState, trained: Sequence[str], ctx: FitContext) -> ModelState:
        return OrderedDict((n, state[n]) for n in trained)
