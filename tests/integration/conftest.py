"""Fixtures for integration tests."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

import pytest
import torch

from harness import InProcessCoordinator


@pytest.fixture
def small_state() -> "OrderedDict[str, torch.Tensor]":
    g = torch.Generator().manual_seed(0)
    return OrderedDict(
        [("layer.weight", torch.randn(4, 3, generator=g)), ("layer.bias", torch.randn(4, generator=g)), ("steps", torch.tensor(7))]
    )


@pytest.fixture
def coordinator(small_state) -> Iterator[InProcessCoordinator]:
    c = InProcessCoordinator(small_state)
    yield c
    c.stop()
