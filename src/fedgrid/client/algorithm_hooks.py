"""The client-algorithm contract: ``ClientAlgorithm``'s hooks, which every trainer calls in the
same order, and what they see (``FitContext``, ``Loop``, the ``Trainer``). The hooks' order and
how the trainers call them: ``fedgrid.client.algorithms``, which registers the built-ins."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Mapping, NamedTuple, Protocol, Sequence

import torch
from torch import nn

from fedgrid.types import ModelState, Scalar

__all__ = ["ClientAlgorithm", "FitContext", "Loop", "OptimizerFactory", "Trainer"]

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
    """The client half of one training algorithm: the hooks every trainer calls (``fedgrid.client.algorithms``' docstring).

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
