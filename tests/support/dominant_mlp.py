"""A model for tests whose one layer dominates: ``--model dominant_mlp:model`` on digits.

``64 -> 256 -> 10``: the first layer's weight is 16,384 of its 19,210 parameters (85%), so
streaming DiLoCo's fragments split it by rows (``fedgrid.aggregation.blocks.default_blocks``).
"""

from __future__ import annotations

from torch import nn


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
