"""The worker app of ``benchmarks/goodput.py``: the built-in client, with its speed set by the benchmark.

``fedgrid client --app goodput_app:client`` (``benchmarks/`` on ``PYTHONPATH``) builds the
built-in client of ``GOODPUT_DATASET`` / ``GOODPUT_MODEL`` (and ``GOODPUT_DATA_DIR``,
``GOODPUT_BATCH_SIZE``) and changes how long each of its inner steps takes:

- ``GOODPUT_SLOW_PARTITION`` names the partition that runs at half speed
  (``GOODPUT_SLOWDOWN``, default 2): after each optimizer step it waits
  ``(slowdown - 1)`` times as long as the step took, as a GPU of half the throughput would.
- ``GOODPUT_STEP_S`` > 0 is the calibrated-wait mode: a step computes nothing (a zero loss
  on one scalar, so the optimizer moves nothing) and waits ``GOODPUT_STEP_S`` seconds (times
  the slowdown on the slow partition) instead: the measured step time of the real model, so
  that four workers can "compute" at once on a machine of two cores. The wait happens inside
  the trainer, so the runtime counts it as compute, as it would the real step.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from fedgrid.client.torch_client import TorchClient
from fedgrid.simulation.tasks import ClientOptions, builtin_client

_pause = threading.Event()  # never set: waits that no signal or spurious wake-up cuts short


def _wait(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        _pause.wait(left)


class PacedClient(TorchClient):
    """A ``TorchClient`` whose steps take the time the benchmark sets (module docstring)."""

    step_s: float = 0.0
    slowdown: float = 1.0

    def _batch_loss(
        self, module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        if self.step_s > 0:
            _wait(self.step_s * self.slowdown)
            anchor = next(p for p in module.parameters() if p.requires_grad)
            return anchor.flatten()[0] * 0.0, 0.0
        started = time.monotonic()
        self._step_started = started
        return super()._batch_loss(module, inputs, targets)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    client = _CLIENT
    if client is None or client.step_s > 0 or client.slowdown <= 1:
        return
    started = getattr(client, "_step_started", None)
    if started is not None:
        _wait((client.slowdown - 1) * (time.monotonic() - started))


_CLIENT: PacedClient | None = None


def client(partition: int, num_partitions: int, seed: int) -> PacedClient:
    global _CLIENT
    env = os.environ
    built = builtin_client(
        partition,
        num_partitions,
        seed,
        options=ClientOptions(
            dataset=env.get("GOODPUT_DATASET", "shakespeare"),
            data_dir=env.get("GOODPUT_DATA_DIR", ""),
            model=env.get("GOODPUT_MODEL", ""),
            batch_size=int(env.get("GOODPUT_BATCH_SIZE", "16")),
        ),
    )
    built.__class__ = PacedClient  # same state, paced steps
    paced: PacedClient = built  # type: ignore[assignment]
    paced.step_s = float(env.get("GOODPUT_STEP_S", "0"))
    if str(partition) == env.get("GOODPUT_SLOW_PARTITION", ""):
        paced.slowdown = float(env.get("GOODPUT_SLOWDOWN", "2"))
    _CLIENT = paced
    return paced


register_optimizer_step_post_hook(_after_step)
