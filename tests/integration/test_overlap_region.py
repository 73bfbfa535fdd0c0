"""Overlapped workers behind a region: the region's own strategy (streaming DiLoCo with tau > 0)
relays its tasks to its workers, which overlap as anywhere else; a global task that asks the
region itself to overlap is refused by name."""

from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid.aggregation import StreamingDiLoCo
from fedgrid.client.torch_client import TorchClient
from fedgrid.region.region import RegionClient
from fedgrid.seeding import RNG_LOCK
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import Schedule
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.types import FitIns

H, TAU = 4, 2


def _model() -> nn.Module:
    with RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))


def _worker(i: int, steps: list[str]) -> TorchClient:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(60, 4, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())

    class Counted(torch.optim.AdamW):
        def step(self, closure=None):  # type: ignore[override]
            steps.append(
                "lookahead" if threading.current_thread().name.startswith("fedgrid-lookahead") else "fit"
            )
            return super().step(closure)

    return TorchClient(
        _model(),
        DataLoader(data, batch_size=10, shuffle=True),
        nn.functional.cross_entropy,
        lambda params: torch.optim.SGD(params, lr=0.1),
        inner_optimizer=lambda params: Counted(params, lr=0.01),
        device="cpu",
        seed=i,
        name=f"w{i}",
    )


def _region(workers: list[TorchClient]) -> RegionClient:
    engine = RoundEngine(
        strategy=StreamingDiLoCo(num_fragments=2, inner_steps=H, sync_delay_steps=TAU),
        fleet=InProcessFleet(workers),
        schedule=Schedule(
            rounds=0,
            min_clients=1,
            round_timeout=timedelta(seconds=60),
            join_timeout=timedelta(seconds=10),
        ),
    )
    return RegionClient(engine, name="eu", regional_rounds=2)


def test_overlapped_workers_behind_a_region_train_and_their_lookahead_counts():
    steps: list[list[str]] = [[], []]
    workers = [_worker(i, steps[i]) for i in range(2)]
    region = _region(workers)
    state = OrderedDict((k, v.detach().clone()) for k, v in _model().state_dict().items())
    losses = []
    for server_round in (1, 2):  # 2 global tasks of 2 regional rounds: 4 regional rounds
        out = region.fit(state, FitIns(round=server_round, config={}))
        assert out.metrics["region_clients"] == 2.0
        losses.append(out.metrics["loss"])
        state = OrderedDict(out.state)
    for worker, log in zip(workers, steps):
        worker.wait_lookahead()
        # H, then H - tau in each later round; tau after each round, in the background
        assert log.count("fit") == H + 3 * (H - TAU) and log.count("lookahead") == 4 * TAU
    assert losses[1] < losses[0]


def test_a_region_refuses_a_global_task_that_asks_it_to_overlap():
    region = _region([_worker(0, [])])
    state = OrderedDict((k, v.detach().clone()) for k, v in _model().state_dict().items())
    config = {"algorithm": "diloco", "inner_steps": 4, "sync_delay_steps": 2, "merge_alpha": 0.5}
    with pytest.raises(
        ValueError, match=r"asks this region to overlap its sync \(sync_delay_steps, merge_alpha\)"
    ):
        region.fit(state, FitIns(round=1, config=config))
