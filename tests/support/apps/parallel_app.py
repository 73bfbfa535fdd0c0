"""A user app for multi-process client tests: a small MLP on fixed synthetic data.

``client(partition, num_partitions, seed, marker_dir=..., step_s=...)`` is a factory a
``ParallelClient`` calls on every rank (so it lives in an importable module). With
``marker_dir``, every training step writes ``rank-R.pid`` (this process's id) under it and
waits ``step_s`` seconds, so that a test can find a worker mid-round and kill it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid.client import TorchClient

#: Not a multiple of the batch size, nor of the ranks: the last batch splits unevenly.
EXAMPLES = 203
BATCH = 16


def model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))


class MarkedLoss:
    """Cross-entropy that leaves this process's id in ``marker_dir`` at each step, then waits ``step_s``."""

    def __init__(self, marker_dir: str, step_s: float) -> None:
        self.marker_dir, self.step_s = marker_dir, step_s

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.marker_dir:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else 0
            Path(self.marker_dir, f"rank-{rank}.pid").write_text(str(os.getpid()))
            time.sleep(self.step_s)  # slows training down so that a round lasts long enough to be interrupted
        return nn.functional.cross_entropy(outputs, targets)


def client(
    partition: int,
    num_partitions: int,
    seed: int,
    *,
    marker_dir: str = "",
    step_s: float = 0.0,
    batch_size: int = BATCH,
) -> TorchClient:
    g = torch.Generator().manual_seed(7 + partition)
    x = torch.randn(EXAMPLES, 10, generator=g)
    y = torch.randint(0, 3, (EXAMPLES,), generator=g)
    return TorchClient(
        model(),
        DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True),
        MarkedLoss(marker_dir, step_s),
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        device="cpu",
        seed=seed,
        name=f"site-{partition}",
        eval_loader=DataLoader(TensorDataset(x, y), batch_size=64),
    )
