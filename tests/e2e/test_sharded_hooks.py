"""The client algorithms' per-step hooks (Scaffold, FedProx) on DTensor parameters sharded over
two gloo processes (torch.multiprocessing, spawn)."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fedgrid.aggregation.scaffold import CONTROL_DELTA_PREFIX, CONTROL_PREFIX
from fedgrid.client.algorithms import FedProxTraining, FitContext, ScaffoldTraining, full, like


def _sharded_worker(rank: int, store_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        whole = torch.arange(8.0).reshape(4, 2)
        w = nn.Parameter(distribute_tensor(whole.clone(), mesh, [Shard(0)], src_data_rank=None))
        correction = like(torch.ones(4, 2), w)
        assert correction.placements == w.placements and correction.to_local().shape == (2, 2)  # type: ignore[attr-defined]

        scaffold, ctx = ScaffoldTraining(), FitContext(config={}, model=("w",))
        download = OrderedDict(w=whole.clone())
        download[CONTROL_PREFIX + "w"] = torch.full((4, 2), 3.0)
        scaffold.start(download=download, ctx=ctx)
        scaffold.begin(params={"w": w}, ctx=ctx)
        w.grad = distribute_tensor(torch.full((4, 2), -1.0), mesh, [Shard(0)], src_data_rank=None)
        scaffold.after_backward(params={"w": w})
        assert torch.equal(full(w.grad), torch.full((4, 2), 2.0))  # -1 + (c - c_i) = -1 + 3
        deltas = scaffold.upload(state=OrderedDict(w=whole.clone()), trained=["w"], ctx=ctx)
        assert torch.equal(
            deltas[CONTROL_DELTA_PREFIX + "w"], torch.full((4, 2), -1.0)
        )  # gathered: the whole tensor

        prox = FedProxTraining()
        prox.begin(params={"w": w}, ctx=FitContext(config={"proximal_mu": 0.5}, model=("w",)))
        w.grad = None
        prox.after_backward(params={"w": w})  # anchors at w
        with torch.no_grad():
            w.add_(2.0)
        w.grad = None
        prox.after_backward(params={"w": w})
        assert torch.equal(full(w.grad), torch.ones(4, 2))  # 0.5 * 2 everywhere
        # Both ranks past their last collective before either tears gloo down: a rank that
        # exits while its peer's all-gather is still in flight aborts the peer ("terminate
        # called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_scaffold_and_fedprox_hooks_on_dtensor_parameters_over_two_processes(tmp_path):
    mp.start_processes(
        _sharded_worker, args=(str(tmp_path / "store"),), nprocs=2, start_method="spawn", join=True
    )
