"""Mixed precision for a trainer's forward passes: bf16 autocast where the device supports it.

The ``precision`` key (``fedgrid.config_groups.PRECISIONS``):

- ``auto``: bf16 autocast on a CUDA device that supports bf16, float32 elsewhere (the CPU
  included: its bf16 kernels are slower than float32 ones on most CPUs);
- ``bf16``: bf16 autocast on any device (torch autocasts on the CPU too);
- ``fp32``: no autocast.

Autocast changes only the compute dtype of the ops it covers (matmuls, attention): the
parameters, their gradients, the optimizer's state and the uploaded model stay float32,
and losses (``cross_entropy`` is on autocast's float32 list) are computed in float32.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

from fedgrid.config_groups import PRECISIONS

__all__ = ["PRECISIONS", "autocast", "autocast_dtype"]


def autocast_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """The dtype ``precision`` autocasts to on ``device``: ``torch.bfloat16``, or ``None``
    (float32, no autocast).

    Raises:
        ValueError: ``precision`` is not one of ``PRECISIONS``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "bf16":
        return torch.bfloat16
    if precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def autocast(device: torch.device, precision: str) -> ContextManager[object]:
    """A context in which forward passes on ``device`` run at ``precision`` (``torch.autocast``
    in bf16, or nothing for float32).

    Raises:
        ValueError: ``precision`` is not one of ``PRECISIONS``.
    """
    dtype = autocast_dtype(device, precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
