"""A user model factory for tests (``--model linear_factory:model``)."""

from torch import nn


def model() -> nn.Module:
    return nn.Linear(4, 2)
