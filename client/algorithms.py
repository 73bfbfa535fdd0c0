"""The client halves of the training algorithms: one ``ClientAlgorithm`` class each, by ``algorithm`` key.

The server half of each lives in ``fedgrid.aggregation``; it tells clients what to do
through the task config only, so a client reached over gRPC (which sees the config, not
the server-side ``FitIns.expected``) sends exactly the tensors its task declares:

- ``fedavg`` (no ``algorithm`` key: FedAvg and the FedOpt family): train the whole model
  for ``local_epochs``, send the model.
- ``fedprox``: as ``fedavg`` with ``proximal_mu / 2 * ||w - w_global||^2`` added to the loss.
- ``scaffold``: the download holds ``scaffold.c.<name>`` tensors (the server control
  variate) besides the model; each step's gradient is corrected by ``c - c_i``; the upload
  is the model plus ``scaffold.c_delta.<name>`` for every control tensor.
- ``diloco``: ``inner_steps`` steps of a persistent inner optimizer (AdamW by default);
  with ``sync_delay_steps`` (tau) or ``merge_alpha`` above 0, on a replica kept across
  rounds into which the whole download is merged.
- ``streaming-diloco``: as ``diloco`` on a local replica kept across rounds; only the
  ``merge_fragment_prefixes`` tensors are merged from the download, only the
  ``fragment_prefixes`` tensors are sent.

- ``bcd``: only the ``block_prefixes`` tensors train (the rest frozen, their modules in
  eval mode so their buffers stay as downloaded) and only they are sent.

The two DiLoCo halves overlap their sync with training when the task asks (``fedgrid.aggregation.diloco.Overlap``):
``lookahead`` tells the trainer to keep training tau steps after the upload is built, and
``resume`` hands the replica those steps trained to the algorithm, whose next ``start``
merges the download into it with alpha.

Each is a ``ClientAlgorithm``: hooks that every trainer calls in the same order, so the
trainer itself never asks which algorithm runs (``TorchClient.fit``, a multi-process
subclass of it, and the batched simulation engine ``fedgrid.simulation.batched``). A fit
of task ``ctx`` (a ``FitContext``) runs::

    loop(ctx=)                              -> Loop(epochs, steps)
    time_budget(ctx=)                       -> seconds of steps instead of Loop.steps (0: none)
    lookahead(ctx=)                         -> steps to train after the upload (0: none)
    start(download=, ctx=)                  -> the state to load and train from
    trained(names=, ctx=)                   -> the state names that train
    optimizer(trainer=, params=, ctx=)      -> the optimizer of the round
    begin(params=, ctx=)                    -> round-local state (anchors, corrections)
    after_backward(params=)                 after each backward pass, before the step
    upload(state=, trained=, ctx=)          -> the tensors sent

then, when ``lookahead`` is above 0, the trainer trains that many more steps (in the
background while the network works) and calls ``resume(state=)`` with the state they
reached (``None`` if they failed) before the next ``start``. ``state_dict`` /
``load_state_dict`` carry what it keeps across rounds. The batched
engine does not call ``after_backward``: it applies the hook's tensorized form, which an
algorithm states as data (``proximal_mu``, ``correction``, ``record``). An algorithm that
defines ``after_backward`` without restating ``not_batchable`` is trained one client at a
time by that engine, so a new hook cannot be silently skipped there; one with state the
engine cannot stack (DiLoCo's persistent inner optimizer) says why in ``not_batchable``.

The per-step hooks are elementwise on a parameter and its gradient, and tensors they add to
a gradient are distributed like the parameter (``like``), so they run unchanged on sharded
parameters (FSDP2's ``DTensor``) and after DDP's gradient all-reduce.

A new algorithm is one subclass with a ``name``, passed to ``register``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Mapping, NamedTuple, Protocol, Sequence, TypeVar

import torch
from torch import nn

from fedgrid.aggregation.blocks import joined_state, tensor_of
from fedgrid.aggregation.diloco import Overlap
from fedgrid.client.algorithm_math import (
    ProximalTerm,
    ScaffoldControl,
    full,
    like,
    merge,
    names_under,
    rows_of,
    train_only,
)
from fedgrid.lazy import exports
from fedgrid.types import ModelState, Scalar

__all__ = [
    "ALGORITHMS",
    "BlockCoordinateTraining",
    "ClientAlgorithm",
    "DiLoCoTraining",
    "FedAvgTraining",
    "FedProxTraining",
    "FitContext",
    "Loop",
    "OptimizerFactory",
    "ProximalTerm",
    "ScaffoldTraining",
    "ScaffoldControl",
    "StreamingDiLoCoTraining",
    "Trainer",
    "algorithm_of",
    "full",
    "like",
    "merge",
    "names_under",
    "register",
    "train_only",
]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class FitContext:
    """What every per-round hook sees.

    Attributes:
        config: the task config.
        model: the model's ``state_dict`` keys, in order.
        client: the client's name, for messages.
    """

    config: Mapping[str, Scalar]
    model: tuple[str, ...]
    client: str = ""


class Loop(NamedTuple):
    """A fit's length: ``epochs`` passes over the data, or (``steps`` > 0) exactly ``steps`` batches."""

    epochs: int
    steps: int


class Trainer(Protocol):
    """What ``ClientAlgorithm.optimizer`` may use of the client that trains (``TorchClient``)."""

    model: nn.Module
    optimizer_factory: OptimizerFactory

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """A persistent optimizer over all of ``model``'s parameters, made once and kept across rounds."""
        ...


class ClientAlgorithm:
    """The client half of one training algorithm: the hooks every trainer calls (module docstring).

    One instance per client and algorithm, kept across rounds; the defaults are FedAvg's.
    Hooks take keyword arguments only.

    Attributes:
        name: the task config's ``algorithm`` value that selects it.
        not_batchable: ``None``, or why the batched engine leaves this algorithm's clients
            to ``TorchClient.fit`` one by one.
    """

    name: ClassVar[str] = ""
    not_batchable: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "after_backward" in cls.__dict__ and "not_batchable" not in cls.__dict__:
            # The batched engine applies proximal_mu and correction, never after_backward.
            cls.not_batchable = f"{cls.__name__}.after_backward has no batched form (set not_batchable = None once proximal_mu/correction state it)"

    def loop(self, *, ctx: FitContext) -> Loop:
        """How long the fit trains: ``local_epochs`` (default 1) epochs.

        Raises:
            ValueError: a bad value in the task.
        """
        epochs = int(ctx.config.get("local_epochs", 1))
        if epochs < 1:
            raise ValueError(f"local_epochs must be at least 1, got {epochs}")
        return Loop(epochs, 0)

    def time_budget(self, *, ctx: FitContext) -> float:
        """Seconds of the trainer's own compute the fit trains for (at least one step), in place
        of ``loop``'s steps; 0 (the default): ``loop`` decides.

        Raises:
            ValueError: a bad value in the task.
        """
        return 0.0

    def lookahead(self, *, ctx: FitContext) -> int:
        """Steps the trainer trains after ``upload``, on the same model and optimizer, before
        the next ``start`` (overlapped DiLoCo's tau); 0 (the default): none. They count toward
        the next fit's steps, examples and loss.

        Raises:
            ValueError: a bad value in the task.
        """
        return 0

    def resume(self, *, state: ModelState | None) -> None:
        """The state the ``lookahead`` steps reached, to train on from the next ``start``;
        ``None`` when they failed (whatever the algorithm kept of the model is then stale)."""

    def start(self, *, download: ModelState, ctx: FitContext) -> ModelState:
        """The state to load and train from (default: the download as it is)."""
        return download

    def trained(self, *, names: Sequence[str], ctx: FitContext) -> list[str]:
        """Of the state ``names`` trained from (in that order), those that train (default: all).

        Every other parameter is frozen, and modules with none of their tensors here are in
        eval mode (``train_only``).
        """
        return list(names)

    def optimizer(
        self, *, trainer: Trainer, params: Sequence[nn.Parameter], ctx: FitContext
    ) -> torch.optim.Optimizer:
        """The round's optimizer over the trainable ``params`` (default: a fresh one from the
        client's factory over all the model's parameters; the task's ``lr`` is set after).

        The batched engine takes the hyperparameters of what this returns and starts their
        state afresh each round: an optimizer kept across rounds needs ``not_batchable``.
        """
        return trainer.optimizer_factory(trainer.model.parameters())

    def begin(self, *, params: Mapping[str, nn.Parameter], ctx: FitContext) -> None:
        """Starts the round once the start state is loaded; ``params`` are the trainable parameters by name.

        The batched engine passes the client's own parameters, which hold other values than
        the start state there: use them for names, devices and dtypes only.

        Raises:
            ValueError: a bad value in the task.
        """

    def after_backward(self, *, params: Mapping[str, nn.Parameter]) -> None:
        """After each backward pass, before the optimizer's step: may change the gradients.

        Elementwise on each parameter and its gradient, so it works on sharded ``DTensor``
        parameters (add tensors made with ``like``).
        """

    def upload(self, *, state: ModelState, trained: Sequence[str], ctx: FitContext) -> ModelState:
        """What the client sends, from ``state``, the whole model after training (default: all
        of it); ``trained`` is what ``trained`` returned. Ends the round."""
        return state

    # -- the tensorized form of after_backward, for the batched engine ---------------------

    def proximal_mu(self, *, ctx: FitContext) -> float:
        """``mu`` of a ``mu / 2 * ||w - w_start||^2`` term the objective has over the trainable
        parameters (default 0: none); ``w_start`` is their start state.

        Raises:
            ValueError: a bad value in the task.
        """
        return 0.0

    @property
    def correction(self) -> Mapping[str, torch.Tensor]:
        """Between ``begin`` and ``upload``: what each step adds to the gradient, by parameter
        name (default: nothing); the raw gradients of these parameters go to ``record``."""
        return {}

    def record(self, *, name: str, grad_sum: torch.Tensor, count: int) -> None:
        """The sum of ``count`` raw (uncorrected) gradients of ``name`` in the round, from an
        engine that corrects gradients itself (called before ``upload``)."""

    # -- across rounds ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What it keeps across rounds, as top-level keys of the client's state (default: nothing).

        Tensors and plain containers only (a client state file is read with
        ``torch.load(weights_only=True)``); a key names its algorithm, no other one uses it.
        """
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores its keys of a client's state (what ``state_dict`` returned); a key absent
        from ``state`` means a fresh start."""


A = TypeVar("A", bound=type[ClientAlgorithm])

#: ``algorithm`` value -> its client half; ``register`` adds one (absent means ``fedavg``).
ALGORITHMS: dict[str, type[ClientAlgorithm]] = {}


def register(cls: A) -> A:
    """Adds ``cls`` to ``ALGORITHMS`` under ``cls.name`` (usable as a class decorator).

    Raises:
        ValueError: no name, or the name is another class's.
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name (the task config's 'algorithm' value that selects it)")
    if ALGORITHMS.get(cls.name, cls) is not cls:
        raise ValueError(f"algorithm {cls.name!r} is already {ALGORITHMS[cls.name].__name__}'s")
    ALGORITHMS[cls.name] = cls
    return cls


def algorithm_of(config: Mapping[str, Scalar]) -> str:
    """The task's algorithm (``fedavg`` when the config names none).

    Raises:
        ValueError: an algorithm this client does not implement.
    """
    name = str(config.get("algorithm", "fedavg"))
    if name not in ALGORITHMS:
        raise ValueError(f"task asks for algorithm {name!r}; this client implements {', '.join(ALGORITHMS)}")
    return name


# -- the built-in algorithms, registered in the order an unknown algorithm's error lists them --


@register
class FedAvgTraining(ClientAlgorithm):
    """``fedavg`` (also FedAvgM and FedOpt): the defaults, the whole model for ``local_epochs``."""

    name = "fedavg"


@register
class FedProxTraining(ClientAlgorithm):
    """``fedprox``: the gradient of ``proximal_mu / 2 * ||w - w_global||^2`` added at each step."""

    name = "fedprox"
    not_batchable = None  # the batched engine puts proximal_mu's term in its objective

    def __init__(self) -> None:
        self._mu = 0.0
        self._term: ProximalTerm | None = None

    def proximal_mu(self, *, ctx: FitContext) -> float:
        mu = float(ctx.config.get("proximal_mu", 0.0))
        if not (mu >= 0 and mu != float("inf")):
            raise ValueError(f"proximal_mu must be non-negative and finite, got {mu}")
        return mu

    def begin(self, *, params: Mapping[str, nn.Parameter], ctx: FitContext) -> None:
        self._mu, self._term = self.proximal_mu(ctx=ctx), None

    def after_backward(self, *, params: Mapping[str, nn.Parameter]) -> None:
        if self._term is None:
            # Anchored at the first step, before the optimizer moved anything: the start state.
            # Not in begin, which the batched engine also calls, with parameters it does not train.
            self._term = ProximalTerm(list(params.values()), self._mu)
        self._term.add_gradients()

    def upload(self, *, state: ModelState, trained: Sequence[str], ctx: FitContext) -> ModelState:
        self._term = None
        return state


@register
class ScaffoldTraining(ClientAlgorithm):
    """``scaffold``: gradients corrected by ``c - c_i``; uploads the model and the ``c_i`` deltas.

    Attributes:
        control: the client's ``ScaffoldControl`` (its ``c_i``), kept across rounds.
    """

    name = "scaffold"
    not_batchable = None  # the batched engine adds ``correction`` and reports to ``record``

    def __init__(self) -> None:
        self.control = ScaffoldControl()
        self._server: ModelState = OrderedDict()

    def start(self, *, download: ModelState, ctx: FitContext) -> ModelState:
        model, self._server = ScaffoldControl.split(download)
        return model

    def begin(self, *, params: Mapping[str, nn.Parameter], ctx: FitContext) -> None:
        self.control.begin(self._server, params)

    def after_backward(self, *, params: Mapping[str, nn.Parameter]) -> None:
        self.control.correct(params)

    @property
    def correction(self) -> Mapping[str, torch.Tensor]:
        return self.control.correction

    def record(self, *, name: str, grad_sum: torch.Tensor, count: int) -> None:
        self.control.record(name, grad_sum, count)

    def upload(self, *, state: ModelState, trained: Sequence[str], ctx: FitContext) -> ModelState:
        out = OrderedDict(state)
        out.update(self.control.finish(state))
        self._server = OrderedDict()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"scaffold": self.control.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.control = ScaffoldControl()
        if state.get("scaffold") is not None:
            self.control.load_state_dict(state["scaffold"])


@register
class DiLoCoTraining(ClientAlgorithm):
    """``diloco``: ``inner_steps`` steps of the client's persistent inner optimizer (``Trainer.inner_optimizer``).

    With the task's ``sync_delay_steps`` (tau) or ``merge_alpha`` (alpha) above 0
    (``fedgrid.aggregation.diloco.Overlap``) it keeps a replica across rounds and merges the
    download into it: ``alpha * replica + (1 - alpha) * global``; tau steps train after the
    upload (``lookahead``), and the next fit trains the rest of the H.

    Attributes:
        replica: the local model kept across rounds (``None``: none, the next start takes the
            whole download).
    """

    name = "diloco"
    not_batchable = "a persistent inner optimizer per client"
    #: The key of ``replica`` in the client's state (one per algorithm: a client keeps both).
    replica_key: ClassVar[str] = "diloco_replica"

    def __init__(self) -> None:
        self.replica: ModelState | None = None

    def loop(self, *, ctx: FitContext) -> Loop:
        """``Loop(0, inner_steps)``.

        Raises:
            ValueError: ``inner_steps`` below 1, or a bad overlap key (``overlap``).
        """
        steps = int(ctx.config.get("inner_steps", 0))
        if steps < 1:
            raise ValueError(f"inner_steps must be at least 1, got {steps}")
        self.overlap(ctx=ctx)  # a bad overlap key fails the task before any work
        return Loop(0, steps)

    def overlap(self, *, ctx: FitContext) -> Overlap:
        """The overlap the task asks for.

        Raises:
            ConfigError: (a ``ValueError``, naming the key) tau above ``inner_steps``, alpha
                outside [0, 1], a negative or non-finite ``inner_time_s``.
        """
        return Overlap.from_task(ctx.config, inner_steps=int(ctx.config.get("inner_steps", 0)))

    def keeps_replica(self, *, ctx: FitContext) -> bool:
        """Whether this task merges into a replica (tau or alpha above 0) instead of taking the download."""
        return self.overlap(ctx=ctx).keeps_replica

    def time_budget(self, *, ctx: FitContext) -> float:
        return self.overlap(ctx=ctx).inner_time_s

    def lookahead(self, *, ctx: FitContext) -> int:
        return self.overlap(ctx=ctx).sync_delay_steps

    def resume(self, *, state: ModelState | None) -> None:
        self.replica = state

    def merged(self, *, ctx: FitContext) -> list[str]:
        """The names of the tensors a start merges from the download (all of the model's).

        Raises:
            ValueError: a bad value in the task.
        """
        return list(ctx.model)

    def optimizer(
        self, *, trainer: Trainer, params: Sequence[nn.Parameter], ctx: FitContext
    ) -> torch.optim.Optimizer:
        return trainer.inner_optimizer

    def start(self, *, download: ModelState, ctx: FitContext) -> ModelState:
        """The download, or the replica with the ``merged`` tensors merged from it with alpha.

        A task without a replica to merge into (plain synchronous DiLoCo) takes the download
        as it is. A download may be part of the model (streaming: the fragments synced since
        this client's last round, ``FitIns.download``); without a replica, it must be the
        whole model.

        Raises:
            ValueError: a download that is part of the model and no replica to complete it
                (a client restarted without its state), or a download without a tensor the
                task says to merge.
        """
        model = list(ctx.model)
        if not self.keeps_replica(ctx=ctx):
            self.replica = None
            return download
        if not {tensor_of(n) for n in download} <= set(model):
            return download  # not this model: loading it says what differs
        if self.replica is None or list(self.replica) != model:
            whole = _whole_model(download)
            if whole is None or len(whole) < len(model):
                raise ValueError(
                    f"{self.name}: the download holds {len(download)} of the model's {len(model)} tensors (the fragments "
                    f"synced since client {ctx.client!r} last trained), but the client keeps no replica of the rest (restarted "
                    "without its state?); the coordinator sends the whole model after this failed round"
                )
            return whole
        names = self.merged(ctx=ctx)
        missing = [n for n in names if n not in download]
        if missing:
            raise ValueError(
                f"{self.name}: the download lacks {len(missing)} tensors the task says to merge (first: {missing[0]!r})"
            )
        return merge(self.replica, download, names, self.overlap(ctx=ctx).merge_alpha)

    def upload(self, *, state: ModelState, trained: Sequence[str], ctx: FitContext) -> ModelState:
        if not self.keeps_replica(ctx=ctx):
            return state
        self.replica = state
        return OrderedDict(
            state
        )  # not the OwnedState: a receiver in this process must not keep the replica's tensors

    def state_dict(self) -> dict[str, Any]:
        return {
            self.replica_key: None
            if self.replica is None
            else OrderedDict((n, t.clone()) for n, t in self.replica.items())
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        replica = state.get(self.replica_key)
        self.replica = (
            None if replica is None else OrderedDict((n, t.detach().clone()) for n, t in replica.items())
        )


def _whole_model(download: ModelState) -> ModelState | None:
    """``download`` with its row slices joined into whole tensors (``blocks.joined_state``);
    ``None`` when it holds only part of a split tensor's rows."""
    try:
        return joined_state(download)
    except ValueError:
        return None


@register
class StreamingDiLoCoTraining(DiLoCoTraining):
    """``streaming-diloco``: DiLoCo on a replica kept across rounds; fragments merged and sent.

    Every task keeps the replica (alpha 0, a plain replace of the merged fragments, unless
    the task says otherwise); ``merge_fragment_prefixes`` names what is merged. A fragment
    may hold row slices of a tensor (``fedgrid.aggregation.blocks.row_slice_name``): the
    download holds them under their names, a merge takes them into those rows of the replica
    (``merge``), the upload sends those rows (``rows_of``), and a download of the whole model
    is joined back into whole tensors.
    """

    name = "streaming-diloco"
    not_batchable = "a persistent inner optimizer and replica per client"
    replica_key = "replica"

    def keeps_replica(self, *, ctx: FitContext) -> bool:
        return True

    def merged(self, *, ctx: FitContext) -> list[str]:
        return names_under(
            ctx.model, str(ctx.config.get("merge_fragment_prefixes", "")), key="merge_fragment_prefixes"
        )

    def upload(self, *, state: ModelState, trained: Sequence[str], ctx: FitContext) -> ModelState:
        self.replica = state
        return OrderedDict(
            (n, rows_of(state, n))
            for n in names_under(
                trained, str(ctx.config.get("fragment_prefixes", "")), key="fragment_prefixes"
            )
        )


@register
class BlockCoordinateTraining(ClientAlgorithm):
    """``bcd``: only the ``block_prefixes`` tensors train, with optimizer state for them alone, and are sent."""

    name = "bcd"

    def trained(self, *, names: Sequence[str], ctx: FitContext) -> list[str]:
        return names_under(names, str(ctx.config.get("block_prefixes", "")), key="block_prefixes")

    def optimizer(
        self, *, trainer: Trainer, params: Sequence[nn.Parameter], ctx: FitContext
    ) -> torch.optim.Optimizer:
        return trainer.optimizer_factory(params)

    def upload(self, *, state: ModelState, trained: Sequence[str], ctx: FitContext) -> ModelState:
        return OrderedDict((n, state[n]) for n in trained)


#: Old names, for one release: each access warns with a DeprecationWarning naming the new one.
__getattr__, _ = exports(
    __name__,
    {},
    deprecated={
        n: f"{__name__}.{n}Training"
        for n in ("FedAvg", "FedProx", "Scaffold", "DiLoCo", "StreamingDiLoCo", "BlockCoordinate")
    },
    globals_=globals(),
)
