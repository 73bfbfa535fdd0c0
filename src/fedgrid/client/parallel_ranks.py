"""Every rank's side of a ``ParallelClient`` (``fedgrid.client.parallel``): the seams that
make a ``TorchClient`` train as one of ``world`` ranks (DDP, FSDP2 or HSDP), rank 0's
broadcasts of the model, and the command channel over the group's store that the other
ranks serve (``worker_main`` for started ranks, ``serve_commands`` for every rank but 0).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from fedgrid.client.torch_client import TorchClient
from fedgrid.types import FitIns, ModelState

if TYPE_CHECKING:
    from fedgrid.client.parallel import ParallelSpec

__all__ = [
    "IDLE_POLL_S",
    "Commands",
    "broadcast_object",
    "broadcast_state",
    "checked_torch_client",
    "device_for",
    "distribute",
    "forked_rank",
    "group_backends",
    "rank_context",
    "serve_commands",
    "worker_main",
]

#: How long an idle worker waits on the store before checking that rank 0 is still alive.
IDLE_POLL_S = 5.0
COMMAND_KEY = "fedgrid/command/{}"


def device_for(backend: str, local_rank: int) -> torch.device:
    """The device a rank trains on: its local GPU under NCCL, else the CPU."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def _comm_hook(spec: ParallelSpec) -> tuple[Any, Any] | None:
    """(state, hook) for ``DistributedDataParallel.register_comm_hook``; ``None`` for ``none``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    name, _, rank = spec.comm_hook.partition(":")
    if name == "none":
        return None
    if name == "fp16":
        return None, default_hooks.fp16_compress_hook
    if name == "bf16":
        return None, default_hooks.bf16_compress_hook
    # Compress from the second step on: a federated round is a few hundred steps, not the
    # thousands of warm-up steps PowerSGD's default assumes; error feedback keeps it unbiased.
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=int(rank or 1),
        start_powerSGD_iter=2,
        min_compression_rate=1.0,
    )
    return state, powerSGD_hook.powerSGD_hook


class _DistributedSeams:
    """Mixed into the factory's ``TorchClient`` class on each rank: the seams ``TorchClient.fit``
    calls, for a model trained by ``world`` ranks (see the module docstring)."""

    model: nn.Module
    device: torch.device
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    _spec: ParallelSpec
    _rank: int
    _world: int
    _hook: tuple[Any, Any] | None
    _global: tuple[torch.Tensor, torch.Tensor]
    _base: type[TorchClient]  # the factory's class, whose methods these replace
    # Overlapped DiLoCo's lookahead runs before fit returns, on every rank in step (a background
    # thread would interleave its collectives with the next command's); no time budget: each
    # rank's clock would stop it after another number of steps, and the collectives would hang.
    _background_lookahead = False
    _time_budget_allowed = False

    def _load(self, state: Mapping[str, torch.Tensor]) -> None:
        if self._spec.mode == "dp":
            self.model.load_state_dict(state, strict=True)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # Every rank holds the broadcast download; each keeps its own shard. The helper puts
        # DTensors into the dict it is given: a copy, so the caller's stays plain.
        set_model_state_dict(
            self.model, dict(state), options=StateDictOptions(full_state_dict=True, strict=True)
        )

    def _state(self) -> ModelState:
        if self._spec.mode == "dp":
            return OrderedDict((k, v.detach().to("cpu").clone()) for k, v in self.model.state_dict().items())
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return OrderedDict(
            (k, v.detach().to("cpu").clone()) for k, v in full.items() if isinstance(v, torch.Tensor)
        )

    def _training_module(self) -> nn.Module:
        if self._spec.mode != "dp" or self._world == 1:
            return self.model
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            self.model, device_ids=[self.device] if self.device.type == "cuda" else None
        )
        if self._hook is not None:
            ddp.register_comm_hook(*self._hook)
        return ddp

    def _batches(self, *, epochs: int, steps: int) -> Iterator[tuple[Any, Any]]:
        for inputs, targets in self._base._batches(self, epochs=epochs, steps=steps):  # type: ignore[arg-type]
            self._global = (inputs, targets)
            yield (
                torch.tensor_split(inputs, self._world)[self._rank],
                torch.tensor_split(targets, self._world)[self._rank],
            )

    def _batch_loss(
        self, module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        batch = len(self._global[1])
        share = len(targets)
        if share == 0:
            # A batch smaller than the world leaves this rank nothing; it still takes part in
            # the gradient's reduction, with zeros (the forward runs on one row, times zero).
            return module(self._global[0][:1].to(self.device)).sum() * 0.0, 0.0
        loss = self.loss_fn(module(inputs), targets)
        return loss * (share * self._world / batch), float(loss.detach()) * share

    def _reduce_totals(self, loss_sum: float, seen: int) -> tuple[float, int]:
        totals = torch.tensor([loss_sum, float(seen)], dtype=torch.float64)
        dist.all_reduce(totals)  # gloo carries CPU tensors in every group this module makes
        return float(totals[0]), int(totals[1])


def checked_torch_client(client: object) -> TorchClient:
    """``client`` if a factory's product can train on every rank: a ``TorchClient`` whose ``fit`` is TorchClient's.

    Raises:
        TypeError: anything else (named).
    """
    if not isinstance(client, TorchClient):
        raise TypeError(
            f"a parallel client's factory must return a TorchClient (its fit runs on every rank), got {type(client).__name__}"
        )
    if type(client).fit is not TorchClient.fit:
        raise TypeError(
            f"{type(client).__name__} overrides TorchClient.fit: a parallel client runs TorchClient's loop on every rank"
        )
    return client


def _seam_members() -> dict[str, Any]:
    """What ``_DistributedSeams`` puts on the rank's class: its methods and its flags (a flag
    left out would leave the factory's class's value, a background lookahead on every rank)."""
    return {name: value for name, value in vars(_DistributedSeams).items() if not name.startswith("__")}


def distribute(client: TorchClient, spec: ParallelSpec, rank: int, device: torch.device) -> TorchClient:
    """Turns ``client`` (built by the factory on this rank) into its distributed self, in place."""
    checked_torch_client(client)
    world = dist.get_world_size()
    # A subclass of the client's own class with the seams in it (a mixin base would change
    # the instance layout, which ``__class__`` assignment refuses); other overrides stay.
    client.__class__ = type(
        f"Distributed{type(client).__name__}", (type(client),), {**_seam_members(), "_base": type(client)}
    )
    client.device = device
    client.memory_format = (
        "contiguous"  # DDP's buckets and FSDP2's shards take parameters as they are laid out by default
    )
    client.model = client.model.to(device, memory_format=torch.contiguous_format)  # type: ignore[call-overload]
    seams: Any = client
    seams._spec, seams._rank, seams._world = spec, rank, world
    seams._hook = _comm_hook(spec) if spec.mode == "dp" else None
    if spec.mode != "dp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if spec.mode == "hsdp":
            mesh = init_device_mesh(
                device.type, (spec.replicas, spec.shards), mesh_dim_names=("replicate", "shard")
            )
        else:
            mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
        reduce_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(spec.comm_hook.partition(":")[0])
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        # Each block of a ModuleList (a transformer's layers) its own unit, then the root:
        # only one block's full parameters are gathered at a time.
        for module in list(client.model.modules()):
            if isinstance(module, nn.ModuleList):
                for block in module:
                    if any(True for _ in block.parameters()):
                        fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(client.model, mesh=mesh, mp_policy=policy)
    return client


def broadcast_state(state: ModelState | None, device: torch.device) -> ModelState:
    """Rank 0's ``state`` on every rank: names, dtypes and shapes as JSON, then the tensors."""
    header: list[Any] = [None]
    if dist.get_rank() == 0:
        assert state is not None
        header = [[(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in state.items()]]
    dist.broadcast_object_list(header, src=0)  # pickles, among ranks of this node's own group only
    out: ModelState = OrderedDict()
    for name, dtype, shape in header[0]:
        if dist.get_rank() == 0:
            assert state is not None
            tensor = state[name].detach().to(device).contiguous()
        else:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(tensor, src=0)
        out[name] = tensor.cpu() if device.type != "cpu" else tensor
    return out


def broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (pickled, among the ranks of this node's group only)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Commands:
    """Rank 0 tells the other ranks what to do next: numbered JSON commands in the group's store."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.sequence = 0

    def send(self, command: Mapping[str, Any]) -> None:
        self.store.set(COMMAND_KEY.format(self.sequence), json.dumps(command))
        self.sequence += 1

    def receive(self, alive: Callable[[], bool]) -> dict[str, Any]:
        """The next command; waits as long as ``alive()`` holds (checked every ``IDLE_POLL_S``).

        Raises:
            ConnectionError: ``alive()`` turned false (rank 0 is gone).
        """
        key = COMMAND_KEY.format(self.sequence)
        while True:
            try:
                self.store.wait([key], timedelta(seconds=IDLE_POLL_S))
                break
            except RuntimeError:  # the store's timeout: still idle
                if not alive():
                    raise ConnectionError("rank 0 is gone") from None
        self.sequence += 1
        command = json.loads(self.store.get(key))
        if not isinstance(command, dict) or command.get("op") not in ("fit", "evaluate", "stop"):
            raise ValueError(f"unknown command {command!r}")
        return command


def serve_commands(client: TorchClient, commands: Commands, alive: Callable[[], bool]) -> None:
    """A rank other than 0: runs what rank 0 commands until ``stop``; any error ends it."""
    client.load_state_dict(broadcast_object(None))  # rank 0's state across rounds
    while True:
        command = commands.receive(alive)
        if command["op"] == "stop":
            return
        state = broadcast_state(None, client.device)
        if command["op"] == "fit":
            client.fit(state, FitIns(round=int(command["round"]), config=command["config"]))
        else:
            client.evaluate(state, command["config"])


def worker_main(
    rank: int,
    world: int,
    store_path: str,
    spec: ParallelSpec,
    factory: Callable[..., TorchClient],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    parent: int,
    threads: int,
) -> None:
    """A spawned rank: joins the group, builds its client, serves rank 0's commands."""
    if threads:
        torch.set_num_threads(threads)
    backend = spec.resolved_backend
    device = device_for(backend, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        backend=group_backends(backend),
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=spec.collective_timeout_s),
    )
    try:
        client = distribute(factory(*args, **kwargs), spec, rank, device)
        serve_commands(client, Commands(store), alive=_watch(parent))
    finally:
        dist.destroy_process_group()


def rank_context(factory: Callable[..., Any]) -> Any:
    """The multiprocessing context ranks start from: a forkserver that imports, once per process,
    torch and fedgrid (this module) and the factory's module (the application's model and data
    code) unless that is the main script."""
    import torch.multiprocessing as mp

    context = mp.get_context("forkserver")
    preload = [__name__]
    module = getattr(factory, "__module__", None) or "__main__"
    if module not in ("__main__", "__mp_main__"):
        preload.append(module)
    context.set_forkserver_preload(preload)
    return context


def forked_rank(environ: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    """A process forked by the forkserver: multiprocessing brings rank 0's import path over, not
    its environment (the forkserver's is from when it started), so it is set here first; then
    ``target(*args)`` (``worker_main`` for a rank)."""
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def _watch(parent: int) -> Callable[[], bool]:
    """Whether rank 0 (process ``parent``) still runs: the multiprocessing parent's sentinel,
    which closes when it exits (a forked rank's parent process is the forkserver, not rank 0)."""
    import multiprocessing

    starter = multiprocessing.parent_process()
    if starter is None or starter.pid != parent:
        return lambda: os.getppid() == parent
    return starter.is_alive


def group_backends(backend: str) -> str:
    """``init_process_group``'s backend string for a group whose models use ``backend``."""
    # CPU tensors (commands' objects, totals) go through gloo even when the model's go through NCCL.
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
