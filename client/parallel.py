"""A client that trains across its node's devices: DDP, FSDP2 or HSDP, with workers it starts itself.

``ParallelClient`` is a ``Client`` whose ``fit`` runs on ``nproc`` local processes joined in
one ``torch.distributed`` process group (NCCL on GPUs, gloo on CPU). This process is rank 0:
it holds the connection to the coordinator, tells the other ranks what to do, broadcasts the
global model and returns the full trained state. The other ranks are started by the client
itself with ``torch.multiprocessing`` (``spawn``); under ``torchrun --nproc-per-node N -m
fedgrid.cli client ...`` torchrun starts them instead, and rank 0 alone talks to the
coordinator (``serve_torchrun``).

Every rank builds the same ``TorchClient`` from the same factory and runs its ``fit``
unchanged; only the seams ``TorchClient`` leaves for this differ (``_DistributedSeams``):

- **data**: every rank iterates the same loader with the same seed, so it sees the same
  *global* batches, and trains on its contiguous share of each (``torch.tensor_split``). The
  loss of a share is scaled by ``share * world / batch``, so that DDP's (and FSDP's) gradient
  average over ranks is exactly the global batch's mean gradient, also for a last batch
  that does not split evenly. A ``dp=2`` client therefore takes the steps a single-process
  client with the same batch size takes (equal up to float rounding).
- **model**: ``dp`` wraps the model in DDP at each fit, after the algorithm fixed which
  parameters train (BCD's frozen blocks), with the chosen communication hook; ``fsdp`` and
  ``hsdp:RxS`` shard it once with ``fully_shard`` (on a 1-D mesh, or a 2-D mesh of R replica
  groups each sharded S ways) and load and gather it with
  ``torch.distributed.checkpoint.state_dict``'s full-state-dict helpers.
- **totals**: the example count is the sum over ranks and the loss the example-weighted
  mean over ranks.

Commands travel over the process group's store as JSON (a fit's round and config, never
pickles); tensors travel by broadcast. A spawned group's store is a ``FileStore`` in a
private (0700) directory, and gloo is bound to the loopback interface: nothing of it listens
beyond this host. Every collective has the group's timeout (``collective_timeout_s``).

When a worker dies or a collective fails, ``fit`` raises: the runtime reports the round
failed with the reason, and this client tears the group down. The next fit starts the
workers again, on a fresh store, with rank 0's state across rounds (SCAFFOLD's ``c_i``,
DiLoCo's inner optimizer, the streaming replica: ``TorchClient.state_dict``) restored on
every rank.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from fedgrid.client.api import Client, EvaluateOutput, FitOutput
from fedgrid.client.torch_client import TorchClient
from fedgrid.determinism import intra_op_threads
from fedgrid.types import FitIns, ModelState, Scalar

__all__ = ["ParallelSpec", "ParallelClient", "COMM_HOOKS", "serve_torchrun", "torchrun_rank"]

log = logging.getLogger(__name__)

#: ``comm_hook`` values: torch's own DDP communication hooks (``fsdp``/``hsdp``: the
#: reduce-scatter's dtype, through FSDP2's ``MixedPrecisionPolicy``; no PowerSGD there).
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
#: How long an idle worker waits on the store before checking that rank 0 is still alive.
IDLE_POLL_S = 5.0
COMMAND_KEY = "fedgrid/command/{}"


@dataclass(frozen=True)
class ParallelSpec:
    """How a client spreads its training over its node: ``nproc`` ranks, and how they split the model.

    Attributes:
        nproc: local processes (ranks), at least 1.
        mode: ``dp`` (DDP), ``fsdp`` (FSDP2 across all ranks) or ``hsdp`` (FSDP2 on a 2-D mesh).
        replicas: ``hsdp``: replica groups (R of ``hsdp:RxS``); else 1.
        shards: ``hsdp``: shards per replica (S); else ``nproc`` for ``fsdp`` and 1 for ``dp``.
        comm_hook: ``none``, ``fp16``, ``bf16`` or ``powersgd[:RANK]``: gradient compression
            between the local ranks.
        backend: ``nccl`` or ``gloo``; empty: NCCL when CUDA is present, else gloo.
        collective_timeout_s: the timeout of every collective, and of starting the group.
    """

    nproc: int = 1
    mode: str = "dp"
    replicas: int = 1
    shards: int = 1
    comm_hook: str = "none"
    backend: str = ""
    collective_timeout_s: float = 300.0

    @classmethod
    def parse(cls, nproc: int, parallel: str = "dp", *, comm_hook: str = "none", backend: str = "",
              collective_timeout_s: float = 300.0) -> "ParallelSpec":
        """``--nproc-per-node N --parallel dp|fsdp|hsdp:RxS --comm-hook H``, checked.

        Raises:
            ValueError: a bad value, named (``hsdp:RxS`` needs ``R * S == nproc``; PowerSGD is DDP's).
        """
        if not isinstance(nproc, int) or nproc < 1:
            raise ValueError(f"nproc_per_node must be a positive integer, got {nproc!r}")
        mode, _, shape = parallel.partition(":")
        if mode == "dp" and not shape:
            replicas, shards = nproc, 1
        elif mode == "fsdp" and not shape:
            replicas, shards = 1, nproc
        elif mode == "hsdp":
            try:
                r_text, s_text = shape.lower().split("x")
                replicas, shards = int(r_text), int(s_text)
            except ValueError:
                raise ValueError(f"parallel {parallel!r}: expected hsdp:RxS (R replicas, each sharded S ways), e.g. hsdp:2x4") from None
            if replicas < 1 or shards < 1 or replicas * shards != nproc:
                raise ValueError(f"parallel {parallel!r}: R x S must equal nproc_per_node ({nproc}), got {replicas} x {shards}")
        else:
            raise ValueError(f"parallel {parallel!r}: expected dp, fsdp or hsdp:RxS")
        hook, _, hook_rank = comm_hook.partition(":")
        if hook not in COMM_HOOKS or hook_rank and (hook != "powersgd" or not hook_rank.isdigit() or int(hook_rank) < 1):
            raise ValueError(f"comm_hook {comm_hook!r}: expected none, fp16, bf16 or powersgd[:RANK]")
        if hook == "powersgd" and mode != "dp":
            raise ValueError(f"comm_hook {comm_hook!r} is a DDP hook: it needs parallel dp, not {parallel!r}")
        if backend not in ("", "nccl", "gloo"):
            raise ValueError(f"backend {backend!r}: expected nccl or gloo")
        gloo = (backend or ("nccl" if torch.cuda.is_available() else "gloo")) == "gloo"
        if hook == "bf16" and mode == "dp" and gloo:
            raise ValueError(f"comm_hook {comm_hook!r}: torch's bf16 DDP hook needs NCCL (CUDA); on gloo use fp16 or powersgd")
        if not collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be positive, got {collective_timeout_s}")
        return cls(nproc, mode, replicas if mode == "hsdp" else 1, shards if mode != "dp" else 1, comm_hook, backend,
                   float(collective_timeout_s))

    @property
    def resolved_backend(self) -> str:
        return self.backend or ("nccl" if torch.cuda.is_available() else "gloo")


def _device_for(backend: str, local_rank: int) -> torch.device:
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
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=int(rank or 1), start_powerSGD_iter=2,
                                        min_compression_rate=1.0)
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

    def _load(self, state: Mapping[str, torch.Tensor]) -> None:
        if self._spec.mode == "dp":
            self.model.load_state_dict(state, strict=True)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # Every rank holds the broadcast download; each keeps its own shard. The helper puts
        # DTensors into the dict it is given: a copy, so the caller's stays plain.
        set_model_state_dict(self.model, dict(state), options=StateDictOptions(full_state_dict=True, strict=True))

    def _state(self) -> ModelState:
        if self._spec.mode == "dp":
            return OrderedDict((k, v.detach().to("cpu").clone()) for k, v in self.model.state_dict().items())
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return OrderedDict((k, v.detach().to("cpu").clone()) for k, v in full.items() if isinstance(v, torch.Tensor))

    def _training_module(self) -> nn.Module:
        if self._spec.mode != "dp" or self._world == 1:
            return self.model
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(self.model, device_ids=[self.device] if self.device.type == "cuda" else None)
        if self._hook is not None:
            ddp.register_comm_hook(*self._hook)
        return ddp

    def _batches(self, *, epochs: int, steps: int) -> Iterator[tuple[Any, Any]]:
        for inputs, targets in self._base._batches(self, epochs=epochs, steps=steps):  # type: ignore[arg-type]
            self._global = (inputs, targets)
            yield torch.tensor_split(inputs, self._world)[self._rank], torch.tensor_split(targets, self._world)[self._rank]

    def _batch_loss(self, module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, float]:
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


def _checked(client: object) -> TorchClient:
    """``client`` if a factory's product can train on every rank: a ``TorchClient`` whose ``fit`` is TorchClient's.

    Raises:
        TypeError: anything else (named).
    """
    if not isinstance(client, TorchClient):
        raise TypeError(f"a parallel client's factory must return a TorchClient (its fit runs on every rank), got {type(client).__name__}")
    if type(client).fit is not TorchClient.fit:
        raise TypeError(f"{type(client).__name__} overrides TorchClient.fit: a parallel client runs TorchClient's loop on every rank")
    return client


def _distribute(client: TorchClient, spec: ParallelSpec, rank: int, device: torch.device) -> TorchClient:
    """Turns ``client`` (built by the factory on this rank) into its distributed self, in place."""
    _checked(client)
    world = dist.get_world_size()
    # A subclass of the client's own class with the seams in it (a mixin base would change
    # the instance layout, which ``__class__`` assignment refuses); other overrides stay.
    seams_of = {name: value for name, value in vars(_DistributedSeams).items() if callable(value)}
    client.__class__ = type(f"Distributed{type(client).__name__}", (type(client),), {**seams_of, "_base": type(client)})
    client.device = device
    client.memory_format = "contiguous"  # DDP's buckets and FSDP2's shards take parameters as they are laid out by default
    client.model = client.model.to(device, memory_format=torch.contiguous_format)
    seams: Any = client
    seams._spec, seams._rank, seams._world = spec, rank, world
    seams._hook = _comm_hook(spec) if spec.mode == "dp" else None
    if spec.mode != "dp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if spec.mode == "hsdp":
            mesh = init_device_mesh(device.type, (spec.replicas, spec.shards), mesh_dim_names=("replicate", "shard"))
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


def _broadcast_state(state: ModelState | None, device: torch.device) -> ModelState:
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


def _broadcast_object(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class _Commands:
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


def _serve(client: TorchClient, commands: _Commands, alive: Callable[[], bool]) -> None:
    """A rank other than 0: runs what rank 0 commands until ``stop``; any error ends it."""
    client.load_state_dict(_broadcast_object(None))  # rank 0's state across rounds
    while True:
        command = commands.receive(alive)
        if command["op"] == "stop":
            return
        state = _broadcast_state(None, client.device)
        if command["op"] == "fit":
            client.fit(state, FitIns(round=int(command["round"]), config=command["config"]))
        else:
            client.evaluate(state, command["config"])


def _worker_main(rank: int, world: int, store_path: str, spec: ParallelSpec, factory: Callable[..., TorchClient],
                 args: tuple[Any, ...], kwargs: Mapping[str, Any], parent: int, threads: int) -> None:
    """A spawned rank: joins the group, builds its client, serves rank 0's commands."""
    if threads:
        torch.set_num_threads(threads)
    backend = spec.resolved_backend
    device = _device_for(backend, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend=_backends(backend), store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec.collective_timeout_s))
    try:
        client = _distribute(factory(*args, **kwargs), spec, rank, device)
        _serve(client, _Commands(store), alive=lambda: os.getppid() == parent)
    finally:
        dist.destroy_process_group()


def _backends(backend: str) -> str:
    # CPU tensors (commands' objects, totals) go through gloo even when the model's go through NCCL.
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"


class ParallelClient(Client):
    """A ``Client`` that trains on ``spec.nproc`` local ranks; this process is rank 0.

    Args:
        factory: a picklable callable (a module-level function) returning a ``TorchClient``;
            called with ``args`` and ``kwargs`` here and in every worker, so every rank
            builds the same model and data.
        spec: the ranks and how they split the model (``ParallelSpec.parse``).
        threads: torch threads per rank (0: the cores divided among the ranks on CPU).

    Raises:
        TypeError: the factory returns no ``TorchClient``, or one that overrides ``fit``.
    """

    def __init__(self, factory: Callable[..., TorchClient], args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None,
                 *, spec: ParallelSpec, threads: int = 0) -> None:
        self.factory, self.args, self.kwargs = factory, tuple(args), dict(kwargs or {})
        self.spec = spec
        self.threads = threads or (0 if spec.resolved_backend == "nccl" else max(1, (os.cpu_count() or 1) // spec.nproc))
        first = self._build()
        self._local: TorchClient | None = first
        self.name, self.region = first.name, first.region
        self._num_examples, self._evaluates = first.num_examples, first.eval_loader is not None
        self._saved: dict[str, Any] = first.state_dict()
        self._workers: list[Any] = []
        self._dir = ""
        self._commands: _Commands | None = None
        self._generation = 0
        self._lock = threading.Lock()  # fit and evaluate of one client never overlap

    def _build(self) -> TorchClient:
        return _checked(self.factory(*self.args, **self.kwargs))

    @property
    def num_examples(self) -> int:
        return self._num_examples

    @property
    def device(self) -> torch.device:
        return _device_for(self.spec.resolved_backend, 0)

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of ranks 1..N-1 now running (empty before the first task)."""
        return [p.pid for p in self._workers if p.is_alive()]

    def _start(self) -> None:
        """Starts ranks 1..N-1 and joins them in a fresh group; restores the state across rounds."""
        import torch.multiprocessing as mp

        spec, world = self.spec, self.spec.nproc
        backend = spec.resolved_backend
        if dist.is_initialized():
            raise RuntimeError("this process already has a torch.distributed process group (another ParallelClient's, or the "
                               "program's own): a process runs one multi-rank client at a time")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback())  # the workers inherit it
        if backend == "nccl":
            os.environ.setdefault("NCCL_SOCKET_IFNAME", _loopback())
        self._dir = tempfile.mkdtemp(prefix="fedgrid-ranks-")  # 0700: the store is this user's alone
        self._generation += 1
        store_path = os.path.join(self._dir, f"store-{self._generation}")
        context = mp.get_context("spawn")
        self._workers = [
            context.Process(target=_worker_main, name=f"fedgrid-rank-{rank}", daemon=True,
                            args=(rank, world, store_path, spec, self.factory, self.args, self.kwargs, os.getpid(), self.threads))
            for rank in range(1, world)
        ]
        for worker in self._workers:
            worker.start()
        device = _device_for(backend, 0)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend=_backends(backend), store=store, rank=0, world_size=world,
                                timeout=timedelta(seconds=spec.collective_timeout_s))
        local = self._local if self._local is not None else self._build()
        with intra_op_threads(self.threads):
            self._local = _distribute(local, spec, 0, device)
        self._commands = _Commands(store)
        _broadcast_object(self._saved)
        self._local.load_state_dict(self._saved)
        log.info("client %s: %d ranks (%s, %s) started", self.name, world, spec.mode, backend)

    def _teardown(self) -> None:
        """Ends the group and the workers (a stop command if all are alive, else kill); the next
        task starts them again, with a client built afresh (a sharded model belongs to its group)."""
        healthy = self._commands is not None and all(w.is_alive() for w in self._workers)
        if healthy and self._commands is not None:
            try:
                self._commands.send({"op": "stop"})
            except RuntimeError:
                healthy = False
        for worker in self._workers:
            if healthy:
                worker.join(timeout=10.0)
            if worker.is_alive():
                worker.kill()
            worker.join(timeout=10.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        self._workers, self._commands, self._local = [], None, None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    def close(self) -> None:
        """Stops the workers (at exit too: they are daemons, and leave when rank 0 is gone)."""
        with self._lock:
            if self._commands is not None:
                self._teardown()

    def _run(self, op: str, state: ModelState, config: Mapping[str, Scalar], call: Callable[[TorchClient, ModelState], Any],
             round_: int = 0) -> Any:
        """Runs one task on every rank (starting them first if needed); a failure ends the group.

        Raises:
            RuntimeError: a worker died, or a collective failed or timed out; the message
                says which (the runtime reports it as the round's failure).
        """
        with self._lock:
            if self.spec.nproc == 1:  # one rank: no group to start, TorchClient as it is
                assert self._local is not None
                with intra_op_threads(self.threads):
                    return call(self._local, state)
            if self._commands is not None and not all(w.is_alive() for w in self._workers):
                self._teardown()  # a worker died between tasks: start afresh
            try:
                if self._commands is None:
                    self._start()
                assert self._commands is not None and self._local is not None
                self._commands.send({"op": op, "round": round_, "config": dict(config)})
                with intra_op_threads(self.threads):
                    out = call(self._local, _broadcast_state(state, self._local.device))
                dead = [w.name for w in self._workers if not w.is_alive()]
                if dead:
                    raise RuntimeError(f"local worker {dead[0]} exited during the task")
            except Exception as exc:
                reason = self._reason(exc)
                self._teardown()
                raise RuntimeError(f"parallel client ({self.spec.nproc} ranks): {reason}; its workers start again for the next task") from exc
            if op == "fit":
                self._saved = self._local.state_dict()
            return out

    def _reason(self, exc: BaseException) -> str:
        """Why a task failed: the worker that died, if one did (a collective's error only echoes it)."""
        for worker in self._workers:
            worker.join(timeout=1.0)  # a worker that just died needs a moment to be reaped
            if worker.exitcode is not None:
                how = f"killed by signal {-worker.exitcode}" if worker.exitcode < 0 else f"exit code {worker.exitcode}"
                return f"local worker {worker.name} died ({how})"
        return f"{type(exc).__name__}: {exc}"

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        return self._run("fit", state, ins.config, lambda client, full: client.fit(full, ins), ins.round)

    def evaluate(self, state: ModelState, config: Mapping[str, Scalar]) -> EvaluateOutput:
        if not self._evaluates:
            raise NotImplementedError(f"client {self.name!r} has no evaluation data")
        return self._run("evaluate", state, config, lambda client, full: client.evaluate(full, config))

    def state_dict(self) -> dict[str, Any]:
        return self._saved

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with self._lock:
            self._saved = dict(state)
            if self._commands is not None:  # running ranks hold the old state: they start again with this one
                self._teardown()


def _loopback() -> str:
    """The loopback interface's name, for gloo's and NCCL's sockets."""
    return "lo0" if sys.platform == "darwin" else "lo"


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, local rank, world size) when started by torchrun with more than one rank, else ``None``."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        return None
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), world


class _TorchrunClient(Client):
    """Rank 0 of a torchrun group: a ``Client`` whose tasks every rank runs (``serve_torchrun``)."""

    def __init__(self, local: TorchClient, commands: _Commands) -> None:
        self.local, self.commands = local, commands
        self.name, self.region = local.name, local.region

    @property
    def num_examples(self) -> int:
        return self.local.num_examples

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        self.commands.send({"op": "fit", "round": ins.round, "config": dict(ins.config)})
        return self.local.fit(_broadcast_state(state, self.local.device), ins)

    def evaluate(self, state: ModelState, config: Mapping[str, Scalar]) -> EvaluateOutput:
        if self.local.eval_loader is None:
            raise NotImplementedError(f"client {self.name!r} has no evaluation data")
        self.commands.send({"op": "evaluate", "round": 0, "config": dict(config)})
        return self.local.evaluate(_broadcast_state(state, self.local.device), config)

    def state_dict(self) -> dict[str, Any]:
        return self.local.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.local.load_state_dict(state)  # before the first task: the other ranks get it then


def serve_torchrun(client: TorchClient, spec: ParallelSpec, serve: Callable[[Client], Any]) -> Any:
    """Under torchrun: rank 0 runs ``serve(client)`` (the runtime's loop) over a client whose
    tasks all ranks run; every other rank serves rank 0's commands until it stops.

    A rank that fails ends its process, and torchrun (``--max-restarts``) decides what follows.
    """
    ranks = torchrun_rank()
    assert ranks is not None
    rank, local_rank, world = ranks
    backend = spec.resolved_backend
    device = _device_for(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=_backends(backend), timeout=timedelta(seconds=spec.collective_timeout_s))
    store = dist.distributed_c10d._get_default_store()
    commands = _Commands(store)
    try:
        local = _distribute(client, spec, rank, device)
        if rank != 0:
            _serve(local, commands, alive=lambda: True)
            return None
        _broadcast_object(local.state_dict())
        try:
            return serve(_TorchrunClient(local, commands))
        finally:
            commands.send({"op": "stop"})
    finally:
        dist.destroy_process_group()
