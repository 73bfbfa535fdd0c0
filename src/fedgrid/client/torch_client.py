"""``TorchClient``: a ``Client`` built from an ``nn.Module``, a data loader, a loss and an optimizer factory."""

from __future__ import annotations

import copy
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping, Sized

import torch
from torch import nn

from fedgrid.client.algorithms import (
    ALGORITHMS,
    ClientAlgorithm,
    FitContext,
    OptimizerFactory,
    algorithm_of,
    train_only,
)
from fedgrid.client.api import Client, EvaluateOutput, FitOutput, OwnedState
from fedgrid.client.loaders import NotPlainLoader, PlainLoader, plain_loader
from fedgrid.client.local_dp import LocalDP
from fedgrid.client.lookahead import LookaheadMixin
from fedgrid.client.precision import autocast
from fedgrid.client.progress import TaskProgress
from fedgrid.clock import MONOTONIC, Clock
from fedgrid.errors import InterruptedRunError
from fedgrid.interrupts import stopping
from fedgrid.seeding import RNG_LOCK, derive_seed
from fedgrid.types import FitIns, ModelState, Scalar

__all__ = ["TorchClient", "RNG_LOCK", "MEMORY_FORMATS", "default_device", "default_inner_optimizer"]

#: Values of ``TorchClient(memory_format=...)``.
MEMORY_FORMATS = ("auto", "contiguous", "channels_last")


def default_inner_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """DiLoCo's default inner optimizer: AdamW with torch's defaults (lr 1e-3, weight decay 0.01)."""
    return torch.optim.AdamW(params)


def default_device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TorchClient(LookaheadMixin, Client):
    """Trains ``model`` on ``train_loader`` as a task asks.

    Task config keys it reads: ``local_epochs`` (default 1), ``lr`` (overrides the
    optimizer's learning rate), ``round`` and ``seed`` (with this client's own ``seed`` and
    ``name`` they seed shuffling and dropout, so a run is reproducible in any process), and
    ``algorithm`` with its keys: the ``ClientAlgorithm`` registered under that name
    (``fedgrid.client.algorithms``: FedProx's proximal term, SCAFFOLD's control variates,
    DiLoCo's inner steps, streaming DiLoCo's fragments, block-coordinate blocks) whose hooks
    ``fit`` runs. This object holds one instance of each algorithm (``algorithm(name)``), so
    what one keeps across rounds (SCAFFOLD's ``c_i``, the streaming replica) and the DiLoCo
    inner optimizer live here; ``state_dict`` / ``load_state_dict`` save and restore them.

    Overlapped DiLoCo (a task whose algorithm asks for ``lookahead`` steps, tau): ``fit``
    builds its upload, then starts a background thread (one per client) that trains tau more
    inner steps on ``model`` with the same inner optimizer while the runtime uploads, polls
    and downloads (under a time budget, ``inner_time_s``, tau/H of the budget's seconds
    instead); it records its compute on ``timeline``. The next ``fit`` waits for those
    steps (compute still running, not a network wait), hands the state they reached to the
    algorithm, which merges the download into it, and trains the rest of the task's steps;
    the steps' examples and loss count toward that fit. ``evaluate``, ``state_dict`` and
    ``load_state_dict`` wait for them first; if they failed, the next ``fit`` raises their
    error and the replica is dropped. A multi-process trainer (``_background_lookahead``
    False) trains them before ``fit`` returns. The thread is a daemon: a process that exits
    does not wait for it.

    Args:
        model: the module; its ``state_dict`` is what travels.
        train_loader: an iterable of ``(inputs, targets)`` batches.
        loss_fn: ``loss_fn(outputs, targets) -> scalar tensor``.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer``, called at each fit.
        inner_optimizer: DiLoCo's inner optimizer factory, called once and kept across
            rounds; default AdamW (``lr`` of the task overrides its learning rate).
        eval_loader: batches for ``evaluate``; defaults to none (evaluate raises).
        device: where to train; CUDA when present by default.
        seed: this client's seed.
        name: stable label (see ``Client.name``).
        region: region label.
        memory_format: how 2-d convolutions lay out their tensors while training:
            ``channels_last`` (the model's 4-d parameters and 4-d inputs in NHWC, which
            oneDNN's CPU convolutions run faster: 20-35% per step for McMahan's CNN on 2
            cores), ``contiguous`` (as given), or ``auto`` (default): ``channels_last`` for a
            model with an ``nn.Conv2d`` on the CPU. The uploaded state is contiguous either
            way. The same client code trains a simulation and a deployment, so the two stay
            bit-identical.
        local_dp: DP-SGD through Opacus (``fedgrid.client.local_dp``, docs/privacy.rst): each
            example's gradient clipped, noise on every step, ``local_epsilon`` in the fit metrics.
    """

    #: Whether a task may ask for a time budget (``inner_time_s``): each rank of a multi-process
    #: trainer would stop after another number of steps, and their collectives would hang.
    _time_budget_allowed: ClassVar[bool] = True

    def __init__(
        self,
        model: nn.Module,
        train_loader: Iterable,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        optimizer: OptimizerFactory,
        *,
        inner_optimizer: OptimizerFactory | None = None,
        eval_loader: Iterable | None = None,
        device: torch.device | str | None = None,
        seed: int = 0,
        name: str = "",
        region: str = "",
        memory_format: str = "auto",
        local_dp: LocalDP | None = None,
    ) -> None:
        if memory_format not in MEMORY_FORMATS:
            raise ValueError(
                f"memory_format must be one of {', '.join(MEMORY_FORMATS)}, got {memory_format!r}"
            )
        self.memory_format = memory_format
        self._nhwc = False  # channels_last, as the last _lay_out found it
        self.device = torch.device(device) if device is not None else default_device()
        self.model = model.to(self.device)
        self.train_loader = train_loader
        self.loss_fn = loss_fn
        self.optimizer_factory = optimizer
        self.inner_optimizer_factory: OptimizerFactory = inner_optimizer or default_inner_optimizer
        self.eval_loader = eval_loader
        self.seed = seed
        self.name = name
        self.region = region
        self._algorithms: dict[str, ClientAlgorithm] = {}
        self.local_dp = local_dp
        self._inner_optimizer: torch.optim.Optimizer | None = None
        self._lookahead = None
        self._plain: tuple[object, object, PlainLoader | None] | None = (
            None  # (loader, its dataset, plain_loader of it)
        )

    @property
    def num_examples(self) -> int:
        dataset = getattr(self.train_loader, "dataset", None)
        return len(dataset) if dataset is not None else 0

    @property
    def channels_last(self) -> bool:
        """Whether this client trains in channels-last layout (see ``memory_format``)."""
        if self.memory_format == "auto":
            return self.device.type == "cpu" and any(isinstance(m, nn.Conv2d) for m in self.model.modules())
        return self.memory_format == "channels_last"

    def _lay_out(self) -> None:
        """Puts the model's 4-d parameters in the layout ``channels_last`` says (in place: the
        parameters stay the same objects, so a kept optimizer still holds them), and keeps
        the answer for the batches of this fit."""
        self._nhwc = self.channels_last
        layout = torch.channels_last if self._nhwc else torch.contiguous_format
        if any(p.dim() == 4 and not p.is_contiguous(memory_format=layout) for p in self.model.parameters()):
            self.model.to(memory_format=layout)  # type: ignore[call-overload]  # Module.to takes it; its stubs omit it

    def _inputs(self, inputs: Any) -> Any:
        """A batch's inputs on the device, 4-d ones in the layout ``_lay_out`` chose."""
        if self._nhwc and isinstance(inputs, torch.Tensor) and inputs.dim() == 4:
            return inputs.to(self.device, memory_format=torch.channels_last)
        return inputs.to(self.device)

    def _load(self, state: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state, strict=True)

    def _state(self) -> ModelState:
        return OwnedState(
            (k, v.detach().to("cpu").clone(memory_format=torch.contiguous_format))
            for k, v in self.model.state_dict().items()
        )

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The persistent inner optimizer over all parameters (DiLoCo's), created at first use and
        kept across rounds (``fedgrid.client.algorithms.Trainer``)."""
        if self._inner_optimizer is None:
            self._inner_optimizer = self.inner_optimizer_factory(self.model.parameters())
        return self._inner_optimizer

    def algorithm(self, name: str) -> ClientAlgorithm:
        """This client's instance of algorithm ``name`` (``fedgrid.client.algorithms.ALGORITHMS``),
        made at first use and kept, with what it keeps across rounds.

        Raises:
            ValueError: an algorithm that is not registered.
        """
        instance = self._algorithms.get(name)
        if instance is None:
            if name not in ALGORITHMS:
                algorithm_of({"algorithm": name})  # raises, naming those there are
            instance = self._algorithms[name] = ALGORITHMS[name]()
        return instance

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        """Trains from ``state`` as the task's ``algorithm`` asks; returns the tensors it declares.

        The algorithm's hooks (``fedgrid.client.algorithms.ClientAlgorithm``) decide what to
        train from, what trains, with which optimizer, for how long, the gradients of each
        step and what is sent; this method runs them in order around ``_train``, and the
        lookahead after (the class docstring).

        Raises:
            ValueError: an unknown algorithm, a bad task value, no training data, or a download
                the algorithm cannot train from (e.g. a streaming fragment without a replica).
            RuntimeError: the lookahead after the previous task failed (its error named).
        """
        config = ins.config
        name = algorithm_of(config)
        algorithm = self.algorithm(name)
        ctx = FitContext(config=config, model=tuple(self.model.state_dict()), client=self.name)
        epochs, steps = algorithm.loop(ctx=ctx)
        budget = algorithm.time_budget(ctx=ctx)
        ahead = algorithm.lookahead(ctx=ctx)
        if budget and not self._time_budget_allowed:
            raise ValueError(
                f"client {self.name!r} trains on several processes, whose steps must match: it cannot "
                f"take inner_time_s={budget} (a time budget); use inner_steps"
            )
        done = self._take_lookahead(name)
        start = algorithm.start(download=state, ctx=ctx)
        self._lay_out()
        self._load(start)
        trained = algorithm.trained(
            names=list(start), ctx=ctx
        )  # of the whole model, also when the download was part of it
        loss_sum, seen = self._train_task(
            algorithm,
            ctx,
            ins,
            trained=trained,
            epochs=epochs,
            steps=max(steps - done.steps, 0) if done is not None else steps,
            time_s=self._time_left(budget, done),
        )
        if done is not None:  # the lookahead's steps are this task's first ones
            loss_sum, seen = loss_sum + done.loss_sum, seen + done.seen
        if seen == 0:
            raise ValueError(f"client {self.name!r} has no training data")
        out = algorithm.upload(state=self._state(), trained=trained, ctx=ctx)
        if ahead:
            # Under a time budget the lookahead is time too, tau/H of it: in steps, a slow worker's
            # tau steps alone outlast the budget, and its every round ends late for all.
            ahead_s = budget * ahead / steps if budget and steps else 0.0
            self._start_lookahead(algorithm, ctx, ins, trained=trained, steps=ahead, time_s=ahead_s)
        # The weight is the distinct examples trained on, never more than held (and reported
        # at join; the coordinator refuses a claim above that): H steps may cycle the data.
        held = self.num_examples
        num_examples = (min(seen, held) if held else seen) if steps else seen // epochs
        metrics = {"loss": loss_sum / seen, **(self.local_dp.metrics() if self.local_dp else {})}
        return FitOutput(state=out, num_examples=num_examples, metrics=metrics)

    def _train_task(
        self,
        algorithm: ClientAlgorithm,
        ctx: FitContext,
        ins: FitIns,
        *,
        trained: list[str],
        epochs: int,
        steps: int,
        time_s: float,
    ) -> tuple[float, int]:
        """``fit``'s training: the ``trained`` parameters alone, with the algorithm's optimizer
        (at the task's ``lr``), ``begin`` and ``after_backward`` hooks, for ``epochs`` or ``steps``
        or ``time_s`` (``_train``); returns (sum of example losses, examples seen) over every
        process training it."""
        self.model.train()
        with train_only(self.model, trained) as params:
            optimizer = algorithm.optimizer(trainer=self, params=params, ctx=ctx)
            if "lr" in ctx.config:
                for group in optimizer.param_groups:
                    group["lr"] = float(ctx.config["lr"])
            if self.local_dp is not None:  # DP-SGD: per-example clipping and noise at each step
                batch = int(getattr(self.train_loader, "batch_size", None) or 0)
                optimizer = self.local_dp.optimizer(
                    optimizer, batch_size=batch, examples=self.num_examples, seed=self.round_seed(ins)
                )
            named = OrderedDict((n, p) for n, p in self.model.named_parameters() if p.requires_grad)
            algorithm.begin(params=named, ctx=ctx)
            loss_sum, seen = self._train(
                optimizer,
                seed=self.round_seed(ins),
                epochs=epochs,
                steps=steps,
                time_s=time_s,
                after_backward=lambda: algorithm.after_backward(params=named),
                task_round=ins.round,
            )
            return self._reduce_totals(loss_sum, seen)

    def round_seed(self, ins: FitIns) -> int:
        """The seed of this client's shuffling (and dropout) for task ``ins``."""
        return derive_seed(ins.config.get("seed", 0), ins.round, self.seed, self.name)

    def _epoch(self) -> Iterable[Any]:
        """One pass over the loader: a plain ``DataLoader`` is read by indexing its tensors
        (``fedgrid.client.loaders``: the same batches, the same draws from the RNGs, without
        its per-example fetch and collate), any other iterable as it is."""
        loader = self.train_loader
        cached = self._plain
        if cached is None or cached[0] is not loader or cached[1] is not getattr(loader, "dataset", None):
            try:
                plain: PlainLoader | None = plain_loader(loader)
            except NotPlainLoader:
                plain = None
            cached = self._plain = (loader, getattr(loader, "dataset", None), plain)
        return cached[2].batches() if cached[2] is not None else loader

    def _batches(self, *, epochs: int, steps: int) -> Iterator[tuple[Any, Any]]:
        """``epochs`` passes over the loader, or exactly ``steps`` batches (cycling through it)."""
        if not steps:
            for _ in range(epochs):
                yield from self._epoch()
            return
        produced = 0
        while produced < steps:
            before = produced
            for batch in self._epoch():
                yield batch
                produced += 1
                if produced == steps:
                    return
            if produced == before:
                return  # an empty loader: no data to cycle through

    def _train(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        seed: int,
        epochs: int,
        steps: int,
        time_s: float = 0.0,
        after_backward: Callable[[], None] | None = None,
        stop: threading.Event | None = None,
        task_round: int | None = None,
    ) -> tuple[float, int]:
        """The local loop; returns (sum of example losses, examples seen). ``after_backward``
        runs after each backward pass, before the optimizer's step (the algorithm's hook).
        ``time_s`` > 0 trains steps (at least one, cycling through the data) until that many
        seconds have passed, in place of ``epochs`` and ``steps``. Once ``stop`` is set, no
        further step starts (the process is exiting). With ``task_round``, the steps are counted
        as that round's task's progress (``fedgrid.client.progress``: logged, on the heartbeat).

        Raises:
            ValueError: the loader gave no data.
        """
        total_loss, seen = 0.0, 0
        module = self._training_module()
        # torch's RNG is process-wide: clients training in threads of one process (the SDK's
        # start(), a host running several) take turns, so each sees only its own seed.
        with RNG_LOCK, torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            # The generators this client draws from: the CPU's (shuffling, and dropout on the
            # CPU) and its own device's. ``torch.manual_seed`` would also seed every other,
            # lazily initialised accelerator, capturing a traceback per call (a tenth of a
            # 100-client round) and leaking past the fork.
            torch.default_generator.manual_seed(seed)
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    torch.cuda.manual_seed(seed)
            began = time.monotonic()
            batches = (
                self._batches(epochs=0, steps=sys.maxsize)
                if time_s > 0
                else self._batches(epochs=epochs, steps=steps)
            )
            progress = (
                None
                if task_round is None
                else TaskProgress(
                    round=task_round,
                    steps_total=0 if time_s > 0 else steps or epochs * self._epoch_steps(),
                    time_s=time_s,
                    board=self.progress,
                    clock=self.progress_clock,
                )
            )
            for inputs, targets in batches:
                if seen and time_s > 0 and time.monotonic() - began >= time_s:
                    break
                if stop is not None and stop.is_set():
                    break
                if stopping():  # a signal (fedgrid.interrupts): given up, never cut short
                    raise InterruptedRunError("training given up: the process is stopping")
                inputs, targets = self._inputs(inputs), targets.to(self.device)
                optimizer.zero_grad(set_to_none=True)
                loss, example_loss_sum = self._batch_loss(module, inputs, targets)
                loss.backward()
                if after_backward is not None:
                    after_backward()
                optimizer.step()
                total_loss += example_loss_sum
                seen += len(targets)
                if progress is not None:
                    progress.step(len(targets), targets.numel() if targets.dim() > 1 else 0)
            if progress is not None:
                progress.close()
        # The last step's gradients are no use between rounds; kept, they are a second model per
        # client (in a 100-client CNN simulation, 650 MB of the process).
        optimizer.zero_grad(set_to_none=True)
        return total_loss, seen

    #: The clock of the progress inside a task (``fedgrid.client.progress``; a test's ``ManualClock``).
    progress_clock: Clock = MONOTONIC

    def _epoch_steps(self) -> int:
        """Batches in one pass over the loader (0: it cannot say)."""
        loader = self.train_loader
        return len(loader) if isinstance(loader, Sized) else 0

    # Seams a trainer over several processes (``fedgrid.client.parallel``) overrides; the
    # algorithms above call only these, so each works unchanged on a DDP or FSDP client.

    def _training_module(self) -> nn.Module:
        """The module a fit calls, once its trainable parameters are set (``self.model`` here;
        a DDP wrapper of it on a data-parallel client; with local DP, Opacus' per-example wrapper)."""
        return self.local_dp.module(self.model) if self.local_dp is not None else self.model

    #: The forward passes' precision (``fedgrid.client.precision``: ``auto``, ``bf16`` or
    #: ``fp32``); the built-in clients set the ``precision`` key's value.
    precision: str = "fp32"

    def _batch_loss(
        self, module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        """The loss to back-propagate for one batch, and the sum of its example losses; the
        forward pass and the loss run at ``precision`` (the backward pass follows it)."""
        with autocast(self.device, self.precision):
            loss = self.loss_fn(module(inputs), targets)
        return loss, float(loss.detach()) * len(targets)

    def _reduce_totals(self, loss_sum: float, seen: int) -> tuple[float, int]:
        """A fit's (sum of example losses, examples seen) over every process training it."""
        return loss_sum, seen

    def state_dict(self) -> dict[str, Any]:
        """What this client keeps across rounds: the inner optimizer, a finished lookahead's count
        (``lookahead``) and each algorithm's state (SCAFFOLD's ``c_i`` under ``scaffold``,
        streaming DiLoCo's ``replica``, ...). Waits for a running lookahead first.

        Raises:
            ValueError: two algorithms keep state under one key.
        """
        self.wait_lookahead()
        # A snapshot: the optimizer's own state_dict shares its tensors, which later steps change in place.
        state: dict[str, Any] = {
            "inner_optimizer": None
            if self._inner_optimizer is None
            else copy.deepcopy(self._inner_optimizer.state_dict()),
            "lookahead": self._lookahead_state(),
        }
        if self.local_dp is not None:  # its accountant: a restored client keeps its budget
            state["local_dp"] = self.local_dp.state_dict()
        for name in ALGORITHMS:  # every one, so the keys do not depend on which have run
            for key, value in self.algorithm(name).state_dict().items():
                if key in state:
                    raise ValueError(
                        f"algorithm {name!r} keeps state under {key!r}, which another already uses"
                    )
                state[key] = value
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what ``state_dict`` returned (the model's weights come with the next task)."""
        self.wait_lookahead()
        self._restore_lookahead(state.get("lookahead"))
        if state.get("inner_optimizer") is not None:
            self.inner_optimizer.load_state_dict(copy.deepcopy(state["inner_optimizer"]))
        else:
            self._inner_optimizer = None
        if self.local_dp is not None and state.get("local_dp") is not None:
            self.local_dp.load_state_dict(state["local_dp"])
        for name in ALGORITHMS:
            self.algorithm(name).load_state_dict(state)

    @torch.no_grad()
    def evaluate(self, state: ModelState, config: Mapping[str, Scalar]) -> EvaluateOutput:
        if self.eval_loader is None:
            raise NotImplementedError(f"client {self.name!r} has no evaluation data")
        self.wait_lookahead()  # it trains the model this loads into; the replica is the algorithm's by now
        self._load(state)
        self.model.eval()
        total_loss, correct, scored, seen = 0.0, 0, 0, 0
        classification = True
        self._lay_out()
        for inputs, targets in self.eval_loader:
            inputs, targets = self._inputs(inputs), targets.to(self.device)
            with autocast(self.device, self.precision):
                outputs = self.model(inputs)
                total_loss += float(self.loss_fn(outputs, targets)) * len(targets)
            # Accuracy is defined only for scores over classes (the last dimension) against
            # integer labels of the other dimensions: [N, C] against [N], or a language model's
            # [N, T, V] against [N, T] (token accuracy).
            classification = (
                classification
                and outputs.dim() in (2, 3)
                and outputs.shape[:-1] == targets.shape
                and not targets.is_floating_point()
            )
            if classification:
                correct += int((outputs.argmax(dim=-1) == targets).sum())
                scored += targets.numel()
            seen += len(targets)
        metrics = {"loss": total_loss / max(seen, 1)}
        if scored and classification:
            metrics["accuracy"] = correct / scored
        return EvaluateOutput(num_examples=seen, metrics=metrics)
