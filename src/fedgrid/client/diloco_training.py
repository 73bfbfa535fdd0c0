"""The client halves of DiLoCo: ``diloco`` (inner steps of a persistent inner optimizer, with an
optional replica kept across rounds for overlapped syncs) and ``streaming-diloco`` (a replica
into which only the synced fragments are merged, and from which only they are sent)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, ClassVar, Mapping, Sequence

import torch
from torch import nn

from fedgrid.aggregation.blocks import joined_state, tensor_of
from fedgrid.aggregation.diloco import Overlap
from fedgrid.client.algorithm_hooks import ClientAlgorithm, FitContext, Loop, Trainer
from fedgrid.client.algorithm_math import merge, names_under, rows_of
from fedgrid.types import ModelState

__all__ = ["DiLoCoTraining", "StreamingDiLoCoTraining"]


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
