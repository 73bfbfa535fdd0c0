"""The batched engine: K ``TorchClient`` clients of one model trained at once on one device.

Each chunk of K clients holds its parameters stacked (leading dimension K). One step runs
``torch.func.vmap`` over ``grad_and_value`` of ``functional_call`` (every client's forward
and backward in one batched kernel per layer), then one batched optimizer step
(``batched_optim``). A client's update is what ``TorchClient.fit`` computes alone:

- the same batches in the same order: its index batches come from iterating a look-alike
  ``DataLoader`` over ``range(n)`` under the seed and RNG fork ``TorchClient`` uses, which
  draws the same random numbers (the iterator's base seed, then ``RandomSampler``'s);
- unequal data: batches are padded to ``[K, B]`` and masked; a client's loss is the mean of
  its own per-example losses (its ``loss_fn`` applied to one example at a time), so padding
  changes nothing; clients are sorted by their number of steps, so the clients still active
  at step ``s`` are a prefix ``[:k]`` of the stacks: no gather, no compute for finished ones;
- algorithms: the client's own ``ClientAlgorithm`` (``fedgrid.client.algorithms``) gives
  the loop, the start state, the trained names, the optimizer's hyperparameters and the
  upload through the hooks ``fit`` calls; its step hook comes as data: ``proximal_mu`` (a
  proximal term in the objective, FedProx) and ``correction`` (added to each step's
  gradient, SCAFFOLD, whose raw gradient sums go back through ``record``). An algorithm
  that is ``not_batchable`` (DiLoCo's persistent inner optimizer and replica), or that runs
  inner steps, trains through ``TorchClient.fit`` one client at a time.

What cannot batch (``NotBatchable``, checked when the trainer is built): clients that are not
plain ``TorchClient``; loaders other than a ``DataLoader`` (``num_workers=0``, default
collate, ``RandomSampler``/``SequentialSampler``) over a ``TensorDataset`` or a ``Subset``
of one; optimizers other than SGD/Adam/AdamW; BatchNorm (running statistics are updated in
place, which vmap cannot batch, and batch statistics would include padding); dropout
(masks drawn per client in one batched call would not be the ones drawn alone); losses that
are not a mean over examples; and anything a one-step trial call rejects (data-dependent
control flow, ops without a batching rule that fail); and clients whose ``precision``
autocasts (``fedgrid.client.precision``: the trial step compares against float32).

Its parts: ``batched_models`` (what the engine reads of a model and its clients),
``batched_trial`` (the checks and the trial step when the trainer is built),
``batched_step`` (the vmapped gradient step), ``batched_memory`` (which engine pays, and
how many clients fit) and ``batched_optim`` (the batched optimizer step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeAlias, Union

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import TensorDataset

from fedgrid.allocator import MMAP_THRESHOLD_MAX
from fedgrid.client.algorithms import ClientAlgorithm, FitContext, algorithm_of, train_only
from fedgrid.client.api import Client, FitOutput, OwnedState
from fedgrid.client.progress import TaskProgress
from fedgrid.client.torch_client import RNG_LOCK
from fedgrid.errors import InterruptedRunError
from fedgrid.interrupts import stopping
from fedgrid.simulation.batched_memory import choose_engine, memory_budget, out_of_memory
from fedgrid.simulation.batched_models import ClientStatic, ModelLayout, loader_size, recurrent_module
from fedgrid.simulation.batched_optim import BatchedOptimizer, NotBatchable, OptimizerSpec, optimizer_spec
from fedgrid.simulation.batched_step import step_function
from fedgrid.simulation.batched_trial import inspect_clients, trial
from fedgrid.types import FitIns, ModelState

__all__ = [
    "BatchedTrainer",
    "NotBatchable",
    "choose_engine",
    "memory_budget",
    "out_of_memory",
    "recurrent_module",
    "StackedRows",
]

log = logging.getLogger(__name__)

Outcome: TypeAlias = Union[FitOutput, Exception]


class StackedRows(OwnedState):
    """A client's trained state from the batched engine: its tensors are its rows of the
    chunk's stacks (on the CPU, contiguous), which nothing else holds or changes. The fleet
    takes them without a copy, and ``FedAvg`` averages a stack's rows in one reduction
    (``fedgrid.aggregation.mean.weighted_mean_of_rows``)."""


@dataclass
class _Job:
    """One client's task of this round, ready to train batched."""

    pos: int
    static: ClientStatic
    state: ModelState  # what the algorithm's ``start`` hook gave to train from
    algorithm: ClientAlgorithm  # the client's own instance
    ctx: FitContext
    epochs: int
    trained: tuple[str, ...]  # canonical parameters that train
    names: tuple[
        str, ...
    ]  # state keys that train (the ``trained`` hook's), for ``train_only`` and ``upload``
    spec: OptimizerSpec
    mu: float
    batches: list[torch.Tensor]
    round: int = 0  # the task's (its progress: fedgrid.client.progress)


class BatchedTrainer:
    """Trains ``TorchClient`` clients in batched chunks (see the module docstring).

    Args:
        clients: the fleet's clients; client ``i`` is ``clients[i]``.
        batch_clients: clients per chunk (K); 0 chooses from device memory:
            ``K = memory_budget(device) // (P * (4 + S) + 3 * A)`` with P the bytes of one
            model's parameters and buffers, S the optimizer's state tensors per parameter
            (0 plain SGD, 1 momentum, 2 Adam), 4 for the parameters, their gradients, a
            frozen/anchor copy and a correction (SCAFFOLD) or temporary, and A the bytes of
            the outputs of every leaf module for one client's batch (measured in the trial
            step): activations kept for backward, their gradients and temporaries. On CPU
            K is also at most ``32 MiB // T``, T the largest single tensor of one client (a
            parameter or a module's output), so stacked temporaries stay below glibc's
            largest mmap threshold. A group of clients is split into chunks of even size.
            A chunk that runs out of memory trains as two halves, and K stays at most the
            half for that model from then on (``_train_fitting``): no out-of-memory failure
            at any client count, down to one client at a time.

    Attributes:
        reason: why not every client can train batched (``None``: all can).
        conv_share: the largest share of training FLOPs in convolutions among the models.
        device: the device of the clients' models.
    """

    def __init__(self, clients: Sequence[Client], *, batch_clients: int = 0) -> None:
        self.clients = list(clients)
        self.batch_clients = batch_clients
        self.reason: str | None = None
        self.conv_share = 0.0
        self.device = torch.device("cpu")
        self._models: list[ModelLayout] = []
        self._statics: dict[int, ClientStatic] = {}
        self._data: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._rows: dict[int, tuple[tuple[Any, ...], torch.Tensor]] = {}
        self._step_fns: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self._logged_sequential: set[str] = set()
        self._k_caps: dict[int, int] = {}  # model index -> the K that last fit in memory (``_train_fitting``)
        try:
            self._inspect_all()
        except NotBatchable as exc:
            self.reason = str(exc)

    # --- construction -------------------------------------------------------------------

    def _inspect_all(self) -> None:
        inspect_clients(self.clients, self._models, self._statics)
        self.device = self._models[0].device
        for m_index, m in enumerate(self._models):
            users = [s for s in self._statics.values() if s.model == m_index]
            first = next((s for s in users if loader_size(s)), users[0])  # one with data, if any
            label = f"client {first.client.name or first.index!r}"
            try:
                trial(m, first, self._step_fn)
            except NotBatchable as exc:
                raise NotBatchable(f"{label}: {exc}") from None
            except Exception as exc:
                raise NotBatchable(
                    f"{label}: a trial batched step failed ({type(exc).__name__}: {exc})"
                ) from None
            self.conv_share = max(self.conv_share, m.conv_share)

    def _step_fn(
        self, m: ModelLayout, loss_fn: Callable[..., Any], loss_key: object, mu: float
    ) -> Callable[..., Any]:
        """``batched_step.step_function``, one per model, loss and ``mu``."""
        key = (id(m), loss_key, mu)
        if key not in self._step_fns:
            self._step_fns[key] = step_function(m, loss_fn, mu)
        return self._step_fns[key]

    def chunk_size(self, m_index: int = 0, spec: OptimizerSpec | None = None) -> int:
        """K for model ``m_index`` (see the class docstring)."""
        cap = self._k_caps.get(m_index)
        if self.batch_clients > 0:
            return min(self.batch_clients, cap or self.batch_clients)
        m = self._models[m_index]
        states = spec.states if spec is not None else 2
        per_client = m.state_bytes * (4 + states) + 3 * m.activation_bytes
        k = memory_budget(m.device) // max(per_client, 1)
        if m.device.type == "cpu":
            # glibc serves allocations above its largest mmap threshold (32 MiB) with fresh
            # mmap()ed pages, faulted in and zeroed at every step; a stacked gradient or
            # activation kept below it is recycled from the heap (measured: K=100 clients of
            # the 784-200-200-10 MLP ran 1.3x slower per client than K=34 on this machine).
            k = min(k, MMAP_THRESHOLD_MAX // max(m.largest_bytes, 1))
        return max(1, min(k, cap or k))

    @property
    def clients_per_call(self) -> int:
        """How many clients the fleet should hand to one ``fit`` call."""
        return max((self.chunk_size(i) for i in range(len(self._models))), default=1)

    # --- data -------------------------------------------------------------------------

    def _build_data(self) -> None:
        """Concatenates the clients' datasets once per fleet (one tensor per shape and device)."""
        groups: dict[tuple[Any, ...], list[TensorDataset]] = {}
        seen: dict[int, tuple[tuple[Any, ...], int]] = {}
        for s in self._statics.values():
            if id(s.base) in seen:
                continue
            x, y = s.base.tensors
            key = (tuple(x.shape[1:]), x.dtype, tuple(y.shape[1:]), y.dtype, self._models[s.model].device)
            seen[id(s.base)] = (key, sum(len(b) for b in groups.get(key, [])))
            groups.setdefault(key, []).append(s.base)
        for key, bases in groups.items():
            device = key[-1]
            xs = [b.tensors[0] for b in bases]
            ys = [b.tensors[1] for b in bases]
            self._data[key] = (
                xs[0].to(device) if len(xs) == 1 else torch.cat(xs).to(device),
                ys[0].to(device) if len(ys) == 1 else torch.cat(ys).to(device),
            )
        for i, s in self._statics.items():
            key, offset = seen[id(s.base)]
            local = s.local if s.local is not None else torch.arange(len(s.base))
            self._rows[i] = (key, local + offset)

    # --- training ---------------------------------------------------------------------

    def fit(self, jobs: Sequence[tuple[int, ModelState, FitIns]]) -> list[Outcome]:
        """Trains ``(client index, downloaded state, task)`` jobs; one outcome per job, in order.

        A job the batched engine does not handle (an algorithm with persistent inner state, a
        task it cannot parse) runs through the client's own ``fit``, so its result or its
        error is exactly the sequential one.
        """
        if self.reason is not None:
            raise NotBatchable(self.reason)
        if not self._rows:
            self._build_data()
        outcomes: list[Outcome | None] = [None] * len(jobs)
        groups: dict[tuple[Any, ...], list[_Job]] = {}
        for pos, (index, state, ins) in enumerate(jobs):
            try:
                job = self._prepare(pos, self._statics[index], state, ins)
            except Exception:
                job = None
            if job is None:
                outcomes[pos] = self._sequential(index, state, ins)
                continue
            if not job.batches:  # no data: TorchClient raises its own error
                outcomes[pos] = self._sequential(index, state, ins)
                continue
            s = job.static
            key = (
                s.model,
                s.loss_key,
                job.spec,
                job.algorithm.name,
                job.trained,
                frozenset(job.names),
                job.mu,
                self._rows[s.index][0],
            )
            groups.setdefault(key, []).append(job)
        for group in groups.values():
            group.sort(key=lambda j: -len(j.batches))  # similar lengths share a chunk; stable
            k = self.chunk_size(group[0].static.model, group[0].spec)
            k = -(-len(group) // -(-len(group) // k))  # as many chunks as K requires, of even sizes
            for start in range(0, len(group), k):
                chunk = group[start : start + k]
                results: list[Outcome]
                try:
                    results = list(self._train_fitting(chunk))
                except Exception as exc:  # not memory (that halves K): the clients train one by one instead
                    log.warning(
                        "batched engine: a chunk of %d clients failed (%s: %s); training them sequentially",
                        len(chunk),
                        type(exc).__name__,
                        exc,
                    )
                    results = [
                        self._sequential(j.static.index, jobs[j.pos][1], jobs[j.pos][2]) for j in chunk
                    ]
                for job, result in zip(chunk, results):
                    outcomes[job.pos] = result
        return [o if o is not None else RuntimeError("batched engine lost a job") for o in outcomes]

    def _train_fitting(self, chunk: list[_Job]) -> list[FitOutput]:
        """``_train_chunk``, halving the chunk while it runs out of memory.

        K comes from an estimate of memory per client (``chunk_size``); when the device says
        otherwise (a CUDA out-of-memory error, or a failed host allocation), the chunk
        trains as two halves, and K for the model stays at most the half from then on, so
        later rounds do not fail again. A single client that does not fit raises.
        """
        try:
            return self._train_chunk(chunk)
        except Exception as exc:
            if len(chunk) == 1 or not out_of_memory(exc):
                raise
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        # Outside the handler: the traceback, and the stacks its frames hold, are released.
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        half = -(-len(chunk) // 2)
        m_index = chunk[0].static.model
        self._k_caps[m_index] = min(self._k_caps.get(m_index, half), half)
        log.warning(
            "batched engine: %d clients at once ran out of memory on %s (%s); training %d at a time from now on",
            len(chunk),
            self.device,
            reason,
            self._k_caps[m_index],
        )
        return self._train_fitting(chunk[:half]) + self._train_fitting(chunk[half:])

    def _sequential(self, index: int, state: ModelState, ins: FitIns) -> Outcome:
        try:
            return self.clients[index].fit(state, ins)
        except Exception as exc:  # a client's failure is data
            return exc

    def _prepare(self, pos: int, s: ClientStatic, state: ModelState, ins: FitIns) -> _Job | None:
        """The job as the batched engine trains it, from the client's algorithm hooks; None for
        an algorithm that says it is ``not_batchable``, or a step loop (left to ``fit``).

        Raises:
            Exception: anything ``TorchClient.fit`` would reject (the caller lets ``fit`` raise it).
        """
        config = ins.config
        algorithm = s.client.algorithm(algorithm_of(config))
        if algorithm.not_batchable is not None:
            if algorithm.name not in self._logged_sequential:
                self._logged_sequential.add(algorithm.name)
                log.info(
                    "engine: %s clients train sequentially (%s)", algorithm.name, algorithm.not_batchable
                )
            return None
        m = self._models[s.model]
        ctx = FitContext(config=config, model=tuple(m.state_keys), client=s.client.name)
        epochs, steps = algorithm.loop(ctx=ctx)
        if steps:
            return None
        state = algorithm.start(download=state, ctx=ctx)
        if set(state) != set(m.state_keys) or any(tuple(state[k].shape) != m.shapes[k] for k in m.state_keys):
            return None  # load_state_dict raises in fit
        names = algorithm.trained(names=list(state), ctx=ctx)
        chosen = set(names)
        trained = tuple(n for n in m.params if n in chosen)
        model_params = dict(s.client.model.named_parameters())
        spec = optimizer_spec(
            algorithm.optimizer(trainer=s.client, params=[model_params[n] for n in trained], ctx=ctx)
        )
        if "lr" in config:
            spec = spec.with_lr(float(config["lr"]))
        mu = algorithm.proximal_mu(ctx=ctx)
        batches = self._batch_order(
            s, s.client.round_seed(ins), epochs
        )  # last: it may advance a loader's generator
        return _Job(
            pos, s, state, algorithm, ctx, epochs, trained, tuple(names), spec, mu, batches, ins.round
        )

    @staticmethod
    def _batch_order(s: ClientStatic, seed: int, epochs: int) -> list[torch.Tensor]:
        """The client's index batches for the round, as its own loader would yield them under ``seed``
        (``PlainLoader.order``: the same draws from the RNGs, whatever the batch size)."""
        # As TorchClient._train seeds, but only the CPU generator (the one samplers draw from):
        # torch.manual_seed also seeds every lazily initialised accelerator, which costs a
        # traceback capture per call.
        with RNG_LOCK, torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            orders = [s.loader.order() for _ in range(epochs)]
        return [b for order in orders for b in s.loader.index_batches(order)]

    def _batch_rows(
        self, chunk: list[_Job], device: torch.device
    ) -> tuple[list[int], int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chunk's batches as rows of the fleet's data: each client's steps, the padded
        width, ``[K, steps, width]`` row indices (on ``device``), each batch's length, the
        padding mask and each batch's example count (at least 1, on ``device``)."""
        k_all = len(chunk)
        steps = [len(j.batches) for j in chunk]
        width = max(len(b) for j in chunk for b in j.batches)
        idx = torch.zeros(k_all, steps[0], width, dtype=torch.int64)
        lengths = torch.zeros(k_all, steps[0], dtype=torch.int64)
        for i, job in enumerate(chunk):
            padded = pad_sequence(
                job.batches, batch_first=True
            )  # pads with local index 0: a real row, masked
            idx[i, : steps[i], : padded.shape[1]] = self._rows[job.static.index][1][padded]
            lengths[i, : steps[i]] = torch.tensor([len(b) for b in job.batches])
        mask = (torch.arange(width) < lengths.unsqueeze(-1)).to(device)
        count = lengths.clamp(min=1).to(device, torch.float32)
        return steps, width, idx.to(device), lengths, mask, count

    def _train_chunk(self, chunk: list[_Job]) -> list[FitOutput]:
        first = chunk[0]
        m = self._models[first.static.model]
        device = m.device
        data_key = self._rows[first.static.index][0]
        xs, ys = self._data[data_key]
        k_all = len(chunk)
        steps, width, idx, lengths, mask, count = self._batch_rows(chunk, device)
        active = [sum(1 for n in steps if n > s) for s in range(steps[0])]

        def stack(name: str) -> torch.Tensor:
            return torch.stack([j.state[name] for j in chunk]).to(device, m.dtypes[name])

        trained = {n: stack(n) for n in first.trained}
        frozen = {n: stack(n) for n in [*m.params, *m.frozen_params, *m.buffers] if n not in trained}
        anchor = {n: t.clone() for n, t in trained.items()} if first.mu else None
        optimizer = BatchedOptimizer(first.spec, list(trained.values()))
        for (
            job
        ) in chunk:  # here, not in _prepare: round-local state (SCAFFOLD's sums) for one chunk at a time
            params = dict(job.static.client.model.named_parameters())
            job.algorithm.begin(params={n: params[n] for n in first.trained}, ctx=job.ctx)
        corrections = [job.algorithm.correction for job in chunk]
        corrected = list(corrections[0])
        if any(list(c) != corrected for c in corrections):
            raise NotBatchable("the clients of a chunk correct the gradients of different parameters")
        correction = {n: torch.stack([c[n] for c in corrections]).to(device) for n in corrected}
        grad_sums = {n: torch.zeros(trained[n].shape, dtype=torch.float32, device=device) for n in corrected}
        fn = self._step_fn(m, first.static.client.loss_fn, first.static.loss_key, first.mu)
        loss_sums = torch.zeros(k_all, dtype=torch.float64, device=device)
        names = list(trained)
        m.template.train()
        # The chunk's steps as a task's progress (a local run's bar), in examples on the CPU.
        progress = TaskProgress(round=first.round, steps_total=len(active))
        examples = [int(n) for n in lengths.sum(0).tolist()] if active else []
        with train_only(
            m.template, list(first.names)
        ):  # bcd: modules outside the block in eval mode, as in fit
            for s, k in enumerate(active):
                if stopping():
                    raise InterruptedRunError("training given up: the process is stopping")
                progress.step(examples[s])
                rows = idx[:k, s]
                views = {n: t[:k] for n, t in trained.items()}
                grads, (_, loss) = fn(
                    views,
                    {n: t[:k] for n, t in frozen.items()},
                    None if anchor is None else {n: t[:k] for n, t in anchor.items()},
                    xs.index_select(0, rows.reshape(-1)).view(k, width, *xs.shape[1:]),
                    ys.index_select(0, rows.reshape(-1)).view(k, width, *ys.shape[1:]),
                    mask[:k, s],
                    count[:k, s],
                )
                loss_sums[:k] += loss.detach().double() * count[:k, s].double()
                for n, c in correction.items():
                    grad_sums[n][:k] += grads[n].float()
                    grads[n].add_(c[:k])
                optimizer.step(s, k, [views[n] for n in names], [grads[n] for n in names])
        return self._outputs(chunk, m, trained, frozen, loss_sums, lengths, steps, grad_sums)

    def _outputs(
        self,
        chunk: list[_Job],
        m: ModelLayout,
        trained: dict[str, torch.Tensor],
        frozen: dict[str, torch.Tensor],
        loss_sums: torch.Tensor,
        lengths: torch.Tensor,
        steps: list[int],
        grad_sums: dict[str, torch.Tensor],
    ) -> list[FitOutput]:
        trained_cpu = {n: t.detach().to("cpu") for n, t in trained.items()}
        frozen_cpu = {n: t.detach().to("cpu") for n, t in frozen.items()}
        loss_list = loss_sums.tolist()
        seen_list = lengths.sum(dim=1).tolist()
        outputs: list[FitOutput] = []
        for i, job in enumerate(chunk):
            full: ModelState = StackedRows()
            for key in m.state_keys:
                name = m.canonical[key]
                source = trained_cpu.get(name)
                full[key] = (source if source is not None else frozen_cpu[name])[
                    i
                ]  # a row of the stack: no copy
            for n, g in grad_sums.items():
                job.algorithm.record(name=n, grad_sum=g[i], count=steps[i])
            out = job.algorithm.upload(state=full, trained=job.names, ctx=job.ctx)
            seen = int(seen_list[i])
            outputs.append(
                FitOutput(state=out, num_examples=seen // job.epochs, metrics={"loss": loss_list[i] / seen})
            )
        return outputs
