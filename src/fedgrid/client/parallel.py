"""A client that trains across its node's devices: DDP, FSDP2 or HSDP, with workers it starts itself.

``ParallelClient`` is a ``Client`` whose ``fit`` runs on ``nproc`` local processes joined in
one ``torch.distributed`` process group (NCCL on GPUs, gloo on CPU). This process is rank 0:
it holds the connection to the coordinator, tells the other ranks what to do, broadcasts the
global model and returns the full trained state. The other ranks are started by the client
itself with ``torch.multiprocessing``, forked from a forkserver that imported torch once (a
restart after a failure costs a fork, not an interpreter importing torch; each rank takes rank
0's environment and import path as they are at its start); under ``torchrun --nproc-per-node N -m
fedgrid.cli client ...`` torchrun starts them instead, and rank 0 alone talks to the
coordinator (``serve_torchrun``).

Every rank builds the same ``TorchClient`` from the same factory and runs its ``fit``
unchanged; only the seams ``TorchClient`` leaves for this differ (``_DistributedSeams``, in
``parallel_ranks`` with the rest of what runs on every rank):

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

import logging
import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from fedgrid.client.api import Client, EvaluateOutput, FitOutput
from fedgrid.client.parallel_ranks import (
    Commands,
    broadcast_object,
    broadcast_state,
    checked_torch_client,
    device_for,
    distribute,
    forked_rank,
    group_backends,
    rank_context,
    serve_commands,
    worker_main,
)
from fedgrid.client.torch_client import TorchClient
from fedgrid.determinism import intra_op_threads
from fedgrid.types import FitIns, ModelState, Scalar

__all__ = ["ParallelSpec", "ParallelClient", "COMM_HOOKS", "serve_torchrun", "torchrun_rank"]

log = logging.getLogger(__name__)

#: ``comm_hook`` values: torch's own DDP communication hooks (``fsdp``/``hsdp``: the
#: reduce-scatter's dtype, through FSDP2's ``MixedPrecisionPolicy``; no PowerSGD there).
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


def _mesh_shape(nproc: int, parallel: str) -> tuple[str, int, int]:
    """``--parallel``'s mode and its replicas and shards over ``nproc`` ranks (before
    ``ParallelSpec`` normalizes them: ``dp`` counts each rank a replica here).

    Raises:
        ValueError: not ``dp``, ``fsdp`` or ``hsdp:RxS`` with ``R * S == nproc`` (named).
    """
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
            raise ValueError(
                f"parallel {parallel!r}: expected hsdp:RxS (R replicas, each sharded S ways), e.g. hsdp:2x4"
            ) from None
        if replicas < 1 or shards < 1 or replicas * shards != nproc:
            raise ValueError(
                f"parallel {parallel!r}: R x S must equal nproc_per_node ({nproc}), got {replicas} x {shards}"
            )
    else:
        raise ValueError(f"parallel {parallel!r}: expected dp, fsdp or hsdp:RxS")
    return mode, replicas, shards


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
    def parse(
        cls,
        nproc: int,
        parallel: str = "dp",
        *,
        comm_hook: str = "none",
        backend: str = "",
        collective_timeout_s: float = 300.0,
    ) -> "ParallelSpec":
        """``--nproc-per-node N --parallel dp|fsdp|hsdp:RxS --comm-hook H``, checked.

        Raises:
            ValueError: a bad value, named (``hsdp:RxS`` needs ``R * S == nproc``; PowerSGD is DDP's).
        """
        if not isinstance(nproc, int) or nproc < 1:
            raise ValueError(f"nproc_per_node must be a positive integer, got {nproc!r}")
        mode, replicas, shards = _mesh_shape(nproc, parallel)
        hook, _, hook_rank = comm_hook.partition(":")
        if (
            hook not in COMM_HOOKS
            or hook_rank
            and (hook != "powersgd" or not hook_rank.isdigit() or int(hook_rank) < 1)
        ):
            raise ValueError(f"comm_hook {comm_hook!r}: expected none, fp16, bf16 or powersgd[:RANK]")
        if hook == "powersgd" and mode != "dp":
            raise ValueError(f"comm_hook {comm_hook!r} is a DDP hook: it needs parallel dp, not {parallel!r}")
        if backend not in ("", "nccl", "gloo"):
            raise ValueError(f"backend {backend!r}: expected nccl or gloo")
        gloo = (backend or ("nccl" if torch.cuda.is_available() else "gloo")) == "gloo"
        if hook == "bf16" and mode == "dp" and gloo:
            raise ValueError(
                f"comm_hook {comm_hook!r}: torch's bf16 DDP hook needs NCCL (CUDA); on gloo use fp16 or powersgd"
            )
        if not collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be positive, got {collective_timeout_s}")
        return cls(
            nproc,
            mode,
            replicas if mode == "hsdp" else 1,
            shards if mode != "dp" else 1,
            comm_hook,
            backend,
            float(collective_timeout_s),
        )

    @property
    def resolved_backend(self) -> str:
        return self.backend or ("nccl" if torch.cuda.is_available() else "gloo")


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

    def __init__(
        self,
        factory: Callable[..., TorchClient],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        spec: ParallelSpec,
        threads: int = 0,
    ) -> None:
        self.factory, self.args, self.kwargs = factory, tuple(args), dict(kwargs or {})
        self.spec = spec
        self.threads = threads or (
            0 if spec.resolved_backend == "nccl" else max(1, (os.cpu_count() or 1) // spec.nproc)
        )
        first = self._build()
        self._local: TorchClient | None = first
        self.name, self.region = first.name, first.region
        self._adapters = (first.base_hash, first.lora_rank)  # shown at Join (--peft): its ranks' model's
        self._num_examples, self._evaluates = first.num_examples, first.eval_loader is not None
        self._saved: dict[str, Any] = first.state_dict()
        self._workers: list[Any] = []
        self._dir = ""
        self._commands: Commands | None = None
        self._generation = 0
        self._lock = threading.Lock()  # fit and evaluate of one client never overlap

    def _build(self) -> TorchClient:
        return checked_torch_client(self.factory(*self.args, **self.kwargs))

    @property
    def num_examples(self) -> int:
        return self._num_examples

    @property
    def base_hash(self) -> str:
        return self._adapters[0]

    @property
    def lora_rank(self) -> int:
        return self._adapters[1]

    @property
    def device(self) -> torch.device:
        return device_for(self.spec.resolved_backend, 0)

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of ranks 1..N-1 now running (empty before the first task)."""
        return [p.pid for p in self._workers if p.is_alive()]

    def _start(self) -> None:
        """Starts ranks 1..N-1 and joins them in a fresh group; restores the state across rounds."""
        spec, world = self.spec, self.spec.nproc
        backend = spec.resolved_backend
        if dist.is_initialized():
            raise RuntimeError(
                "this process already has a torch.distributed process group (another ParallelClient's, or the "
                "program's own): a process runs one multi-rank client at a time"
            )
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback())  # the workers inherit it
        if backend == "nccl":
            os.environ.setdefault("NCCL_SOCKET_IFNAME", _loopback())
        self._dir = tempfile.mkdtemp(prefix="fedgrid-ranks-")  # 0700: the store is this user's alone
        self._generation += 1
        store_path = os.path.join(self._dir, f"store-{self._generation}")
        context = rank_context(self.factory)
        self._workers = [
            context.Process(
                target=forked_rank,
                name=f"fedgrid-rank-{rank}",
                daemon=True,
                args=(
                    dict(os.environ),
                    worker_main,
                    rank,
                    world,
                    store_path,
                    spec,
                    self.factory,
                    self.args,
                    self.kwargs,
                    os.getpid(),
                    self.threads,
                ),
            )
            for rank in range(1, world)
        ]
        for worker in self._workers:
            worker.start()
        device = device_for(backend, 0)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            backend=group_backends(backend),
            store=store,
            rank=0,
            world_size=world,
            timeout=timedelta(seconds=spec.collective_timeout_s),
        )
        local = self._local if self._local is not None else self._build()
        with intra_op_threads(self.threads):
            self._local = distribute(local, spec, 0, device)
        self._commands = Commands(store)
        broadcast_object(self._saved)
        self._local.load_state_dict(self._saved)
        log.info("client %s: %d ranks (%s, %s) started", self.name, world, spec.mode, backend)

    def _teardown(self, *, polite: bool = True) -> None:
        """Ends the group and the workers (``polite``: a stop command if all are alive; else, and
        after a failed task, whose ranks may hang in a collective, kill); the next task starts them
        again, with a client built afresh (a sharded model belongs to its group)."""
        healthy = polite and self._commands is not None and all(w.is_alive() for w in self._workers)
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

    def _run(
        self,
        op: str,
        state: ModelState,
        config: Mapping[str, Scalar],
        call: Callable[[TorchClient, ModelState], Any],
        round_: int = 0,
    ) -> Any:
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
                    out = call(self._local, broadcast_state(state, self._local.device))
                dead = [w.name for w in self._workers if not w.is_alive()]
                if dead:
                    raise RuntimeError(f"local worker {dead[0]} exited during the task")
            except Exception as exc:
                reason = self._reason(exc)
                self._teardown(polite=False)  # a hung rank would not read a stop: 10 s lost waiting
                raise RuntimeError(
                    f"parallel client ({self.spec.nproc} ranks): {reason}; its workers start again for the next task"
                ) from exc
            if op == "fit":
                self._saved = self._local.state_dict()
            return out

    def _reason(self, exc: BaseException) -> str:
        """Why a task failed: the worker that died, if one did (a collective's error only echoes it)."""
        for worker in self._workers:
            worker.join(timeout=1.0)  # a worker that just died needs a moment to be reaped
            if worker.exitcode is not None:
                how = (
                    f"killed by signal {-worker.exitcode}"
                    if worker.exitcode < 0
                    else f"exit code {worker.exitcode}"
                )
                return f"local worker {worker.name} died ({how})"
        return f"{type(exc).__name__}: {exc}"

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        _refuse_time_budget(ins, f"parallel client {self.name!r} ({self.spec.nproc} ranks)")
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


def _refuse_time_budget(ins: FitIns, who: str) -> None:
    """Refuses a task with a time budget (``inner_time_s``) before any rank starts it: each rank's
    clock would stop it after another number of steps, and their collectives would hang.

    Raises:
        ValueError: naming ``inner_time_s``.
    """
    budget = ins.config.get("inner_time_s")
    if budget is not None and float(budget) > 0:
        raise ValueError(
            f"{who} trains on several processes, whose steps must match: it cannot take "
            f"inner_time_s={budget} (a time budget); use inner_steps"
        )


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

    def __init__(self, local: TorchClient, commands: Commands) -> None:
        self.local, self.commands = local, commands
        self.name, self.region = local.name, local.region

    @property
    def num_examples(self) -> int:
        return self.local.num_examples

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        _refuse_time_budget(ins, f"torchrun client {self.name!r}")
        self.commands.send({"op": "fit", "round": ins.round, "config": dict(ins.config)})
        return self.local.fit(broadcast_state(state, self.local.device), ins)

    def evaluate(self, state: ModelState, config: Mapping[str, Scalar]) -> EvaluateOutput:
        if self.local.eval_loader is None:
            raise NotImplementedError(f"client {self.name!r} has no evaluation data")
        self.commands.send({"op": "evaluate", "round": 0, "config": dict(config)})
        return self.local.evaluate(broadcast_state(state, self.local.device), config)

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
    device = device_for(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=group_backends(backend), timeout=timedelta(seconds=spec.collective_timeout_s)
    )
    store = dist.distributed_c10d._get_default_store()
    commands = Commands(store)
    try:
        local = distribute(client, spec, rank, device)
        if rank != 0:
            serve_commands(local, commands, alive=lambda: True)
            return None
        broadcast_object(local.state_dict())
        try:
            return serve(_TorchrunClient(local, commands))
        finally:
            commands.send({"op": "stop"})
    finally:
        dist.destroy_process_group()
