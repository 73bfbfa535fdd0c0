"""DiLoCo (Douillard et al. 2023) and streaming DiLoCo (Douillard et al. 2025), server side.

DiLoCo: each worker runs ``inner_steps`` (H) steps of its own inner optimizer (AdamW, its
state kept across rounds on the worker) from the global model and sends back its model;
the server applies Nesterov SGD (outer lr 0.7, momentum 0.9) to the averaged
pseudo-gradient ``global - mean(workers)``. That is ``FedOpt`` with a Nesterov outer
optimizer; the task config tells workers ``inner_steps`` and the inner learning rate
(``lr``, from ``inner_lr``).

Defaults. The outer step is the paper's. The inner learning rate is DiLoCo's own
(``inner_lr``, default 1e-3, AdamW's usual rate; the paper uses 4e-4 on transformers), not
the clients' ``lr`` of the epoch-based strategies: that one is an SGD rate (0.1 by
default), and AdamW at 0.1 diverges (digits: accuracy 0.09 after round 1). ``inner_steps``
defaults to 50, not the paper's 500: the paper's workers hold a pre-training corpus, while
a federated client of a few hundred examples would run 500 steps as ~100 local epochs
(digits: 10x the compute of 50 steps per round, for 0.978 instead of 0.908 accuracy after
5 rounds), and 50 batches of 32 is about the work of FedAvg's two local epochs on a client
of 800 examples.

Streaming DiLoCo: the model is split into F fragments (contiguous groups of modules,
balanced by size; ``blocks.default_blocks``). Round ``r`` syncs fragment ``r % F`` only:
workers upload just that fragment (``FitIns.expected``), the server applies the outer
step to it (each fragment has its own outer momentum) and leaves the other fragments as
they were. So only 1/F of the model crosses the uplink per round.

Row slices: a tensor larger than total / F bytes (one layer dominating the model) is split
along dim 0 into contiguous row ranges held by different fragments, so that the fragments
balance by bytes (``default_blocks(..., split_rows=True)`` states the rule and the balance;
a model without such a tensor keeps the fragments it had before). Rows ``a:b`` of tensor
``n`` travel as the tensor ``n#rows=a:b`` (``blocks.row_slice_name``): ``downlink_state`` is
the global model with each split tensor replaced by its slices (``blocks.sliced_state``), and
the tasks' ``expected``, ``download`` and prefixes name the slices, so the fleets, the accept
path (differences are taken against ``downlink_state``) and the codecs see ordinary tensors.
The global model keeps whole tensors; a sync steps the synced rows alone, and the outer
optimizer's state is kept per slice (the same numbers as per tensor: the optimizer is
elementwise). ``load_state_dict`` cuts a checkpoint's whole-tensor state of a split tensor
(written before row slices) into its slices. Evaluation tasks get whole tensors.

Worker side of streaming DiLoCo (what the task config asks): keep a local replica across
rounds; at round ``r`` overwrite the fragments synced since the worker's last round with
the downloaded global values (``merge_fragment_prefixes``: for a worker that trained in
round ``r - 1``, fragment ``merge_fragment`` = ``(r - 1) % F`` alone, the one the server
updated last round), keep training the rest locally, and upload fragment ``fragment``
(= ``r % F``) after the inner steps. A worker without a replica (first round, new worker)
takes the whole global model.

Overlapped syncs (the streaming paper's overlap; ``Overlap``): with ``sync_delay_steps``
(tau) > 0 a worker does not wait for the outer step. Once it has built its upload it keeps
training tau more inner steps on its replica (the "lookahead") while the upload, the outer
step and the download happen; its next task merges the new global values into that replica
with ``merge_alpha`` (alpha), ``local = alpha * local + (1 - alpha) * global`` for floating
tensors (the others take the global value), then trains ``H - tau`` steps, so every sync
interval is still H steps. The merge point is a step number, never an arrival time, so a
simulation and a deployment stay bit-identical. alpha defaults to 0 (replace, as without
overlap) when tau is 0 and to the paper's 0.5 when tau > 0. Plain ``diloco`` keeps a replica
too when tau or alpha is above 0 (it merges the whole model). ``inner_time_s`` (> 0) asks
each worker for that many seconds of inner steps instead of H (speed-aware local work; its
weight counts the examples it processed; not bit-reproducible); its lookahead is then tau/H of
those seconds, not tau steps, so a slow worker's sync leaves with the others'. The server's arithmetic does
not change: a worker's upload is its model after its inner steps, as without overlap.

Downlink: the server remembers, per client (``ClientInfo.client_id``), the last round
whose result it aggregated, and each task downloads (``FitIns.download``) only the
fragments synced since then: one fragment per round for a worker that takes part every
round, so about 1/F of the model crosses the downlink too. A client with no such record
(new, failed in its last round, or absent for F rounds or more, when every fragment has
changed) downloads the whole model and merges all of it. Records are keyed by client id:
it survives a coordinator restart (the fleet restores its membership) and a reconnect within
a session, while a restarted client process joins under a new id and so gets the whole
model, which it needs when it lost its replica. A worker that gets part of the model
without a replica fails its round; the failure drops its record, so it gets the whole
model next round.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from fedgrid.aggregation.base import AggregationPreconditionError, Aggregator
from fedgrid.aggregation.blocks import Block, default_blocks, row_slices, sliced_state
from fedgrid.aggregation.fedavg import train_metrics
from fedgrid.aggregation.fedopt import FedOpt
from fedgrid.aggregation.selection import Sampling
from fedgrid.aggregation.server_opt import ServerSGD
from fedgrid.errors import ConfigError
from fedgrid.types import ClientInfo, Failure, FitIns, FitRes, ModelState, Scalar, TensorSpec, UpdateRole

__all__ = [
    "DiLoCo",
    "StreamingDiLoCo",
    "Overlap",
    "DEFAULT_INNER_LR",
    "DEFAULT_INNER_STEPS",
    "DEFAULT_OVERLAP_ALPHA",
]

#: The inner AdamW's learning rate unless ``inner_lr`` says otherwise (see the module docstring).
DEFAULT_INNER_LR = 1e-3
#: H unless ``inner_steps`` says otherwise (see the module docstring).
DEFAULT_INNER_STEPS = 50
#: alpha when ``sync_delay_steps`` > 0 and ``merge_alpha`` is not given: the streaming paper's recommendation.
DEFAULT_OVERLAP_ALPHA = 0.5


@dataclass(frozen=True)
class Overlap:
    """How a DiLoCo worker overlaps its sync with training (the module docstring).

    Both halves read it: the server from its options (``resolve``), the worker from its task
    config (``from_task``); the defaults are today's synchronous DiLoCo.

    Attributes:
        sync_delay_steps: tau, inner steps trained after the upload is built and before the
            new global values are merged (0: none, the worker waits for them).
        merge_alpha: alpha in [0, 1], the share of the local value kept at a merge.
        inner_time_s: seconds of inner steps per task instead of ``inner_steps`` (0: off).
    """

    sync_delay_steps: int = 0
    merge_alpha: float = 0.0
    inner_time_s: float = 0.0

    @property
    def keeps_replica(self) -> bool:
        """Whether a worker merges into a replica it keeps (tau or alpha above 0) instead of
        taking the download as it is."""
        return self.sync_delay_steps > 0 or self.merge_alpha > 0

    @classmethod
    def resolve(
        cls,
        *,
        inner_steps: int,
        sync_delay_steps: int | None = None,
        merge_alpha: float | None = None,
        inner_time_s: float | None = None,
    ) -> Overlap:
        """The overlap of these options, ``None`` ones at their defaults: tau 0, alpha 0 when
        tau is 0 and ``DEFAULT_OVERLAP_ALPHA`` (0.5) when tau > 0, no time budget.

        Raises:
            ConfigError: (the option's key) tau negative or above ``inner_steps`` (H), alpha
                outside [0, 1], ``inner_time_s`` negative or not finite.
        """
        tau = 0 if sync_delay_steps is None else sync_delay_steps
        if isinstance(tau, bool) or not isinstance(tau, int) or not 0 <= tau <= inner_steps:
            raise ConfigError(
                "sync_delay_steps",
                f"must be a whole number of inner steps in 0..inner_steps ({inner_steps}): the merge happens "
                f"within the next sync interval; got {sync_delay_steps!r} (raise inner_steps or lower it)",
            )
        alpha = (DEFAULT_OVERLAP_ALPHA if tau > 0 else 0.0) if merge_alpha is None else merge_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ConfigError(
                "merge_alpha", f"must be in [0, 1] (the share of the local value kept), got {merge_alpha!r}"
            )
        budget = 0.0 if inner_time_s is None else inner_time_s
        if (
            isinstance(budget, bool)
            or not isinstance(budget, (int, float))
            or not (budget >= 0 and math.isfinite(budget))
        ):
            raise ConfigError(
                "inner_time_s",
                f"must be a finite number of seconds at least 0 (0: off), got {inner_time_s!r}",
            )
        return cls(sync_delay_steps=tau, merge_alpha=float(alpha), inner_time_s=float(budget))

    @classmethod
    def from_task(cls, config: Mapping[str, Scalar], *, inner_steps: int) -> Overlap:
        """The overlap a task config asks for (what ``task_config`` wrote; absent keys: no overlap).

        Raises:
            ConfigError: as ``resolve``, for a task's value.
        """

        def number(key: str, kind: type) -> Any:
            value = config.get(key)
            if value is None:
                return None
            try:
                converted = kind(value)
            except (TypeError, ValueError):
                return value  # resolve names it
            return converted if converted == value or kind is float else value

        return cls.resolve(
            inner_steps=inner_steps,
            sync_delay_steps=number("sync_delay_steps", int),
            merge_alpha=number("merge_alpha", float),
            inner_time_s=number("inner_time_s", float),
        )

    def task_config(self) -> dict[str, Scalar]:
        """The task config keys that ask a worker for this overlap: none for today's synchronous
        DiLoCo, so its tasks stay as they were."""
        out: dict[str, Scalar] = {}
        if self.keeps_replica:
            out.update(sync_delay_steps=self.sync_delay_steps, merge_alpha=self.merge_alpha)
        if self.inner_time_s > 0:
            out["inner_time_s"] = self.inner_time_s
        return out


class DiLoCo(FedOpt):
    """DiLoCo's server: Nesterov outer SGD on the averaged pseudo-gradient.

    Task config sent to workers: ``algorithm = "diloco"``, ``inner_steps``, ``lr`` (= ``inner_lr``),
    and the overlap's keys when it has one (``Overlap.task_config``).

    Args:
        outer_lr: outer learning rate.
        outer_momentum: outer Nesterov momentum.
        inner_steps: H, the inner optimizer steps each worker runs per round.
        inner_lr: the inner optimizer's learning rate, sent as the task's ``lr``.
        sync_delay_steps: tau, the inner steps a worker trains after its upload is built and
            before it merges the new global values (default 0: no overlap; at most H).
        merge_alpha: alpha in [0, 1], the share of the local value a merge keeps (default 0
            when tau is 0, today's replace; 0.5, the streaming paper's value, when tau > 0).
        inner_time_s: seconds of inner steps per task instead of H (default 0: off).
        aggregator: the rule applied to the workers' updates (default: weighted mean).
        sampling: as ``FedAvg`` (which clients a round asks).

    Raises:
        ValueError: an argument is out of range.
        ConfigError: (a ``ValueError``; the option's key) a bad ``sync_delay_steps``,
            ``merge_alpha`` or ``inner_time_s`` (``Overlap.resolve``).
    """

    name = "diloco"
    #: Each worker's update is its pseudo-gradient, an outer optimizer steps on their mean.
    update_role = UpdateRole.OUTER_GRADIENT

    def __init__(
        self,
        *,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        inner_steps: int = DEFAULT_INNER_STEPS,
        inner_lr: float = DEFAULT_INNER_LR,
        sync_delay_steps: int | None = None,
        merge_alpha: float | None = None,
        inner_time_s: float | None = None,
        aggregator: Aggregator | None = None,
        sampling: Sampling | None = None,
    ) -> None:
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be at least 1, got {inner_steps}")
        if not (inner_lr > 0 and math.isfinite(inner_lr)):
            raise ValueError(f"inner_lr must be positive and finite, got {inner_lr}")
        self.overlap = Overlap.resolve(
            inner_steps=inner_steps,
            sync_delay_steps=sync_delay_steps,
            merge_alpha=merge_alpha,
            inner_time_s=inner_time_s,
        )
        super().__init__(
            server_optimizer=ServerSGD(lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0),
            aggregator=aggregator,
            sampling=sampling,
        )
        self.inner_steps = inner_steps
        self.inner_lr = float(inner_lr)

    def _task_config(self, server_round: int) -> dict[str, Scalar]:
        # ``lr`` replaces the clients' epoch-strategy rate that ``fit_config`` may carry.
        return {
            **super()._task_config(server_round),
            "algorithm": self.name,
            "inner_steps": self.inner_steps,
            "lr": self.inner_lr,
            **self.overlap.task_config(),
        }


class StreamingDiLoCo(DiLoCo):
    """Streaming DiLoCo's server: one fragment of the model synced per round, in rotation.

    Task config sent to workers: ``algorithm = "streaming-diloco"``, ``inner_steps``,
    ``fragment`` (the fragment to upload), ``merge_fragment`` (the fragment synced last
    round), ``num_fragments``, ``fragment_prefixes`` (comma-joined name prefixes of
    ``fragment``; see ``blocks.matches_prefix``; a row slice is its own prefix) and
    ``merge_fragment_prefixes`` (those of every fragment the worker takes from the download:
    the fragments synced since its last round, all of them for a client without a record).
    ``FitIns.download`` names the tensors of those fragments in ``downlink_state`` (row
    slices by their names), or is ``None`` (all of it) for a client without a record.

    Args:
        num_fragments: F, the number of fragments.
        others: ``outer_lr``, ``outer_momentum``, ``inner_steps``, ``inner_lr``, ``sync_delay_steps``,
            ``merge_alpha``, ``inner_time_s``, ``aggregator``, ``sampling``: as ``DiLoCo``.

    Raises:
        ValueError: an argument is out of range.
        ConfigError: (at ``initialize``; key ``num_fragments``) the model has fewer tensors
            than fragments.
    """

    name = "streaming-diloco"

    def __init__(
        self,
        *,
        num_fragments: int = 2,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        inner_steps: int = DEFAULT_INNER_STEPS,
        inner_lr: float = DEFAULT_INNER_LR,
        sync_delay_steps: int | None = None,
        merge_alpha: float | None = None,
        inner_time_s: float | None = None,
        aggregator: Aggregator | None = None,
        sampling: Sampling | None = None,
    ) -> None:
        if num_fragments < 1:
            raise ValueError(f"num_fragments must be at least 1, got {num_fragments}")
        super().__init__(
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            inner_steps=inner_steps,
            inner_lr=inner_lr,
            sync_delay_steps=sync_delay_steps,
            merge_alpha=merge_alpha,
            inner_time_s=inner_time_s,
            aggregator=aggregator,
            sampling=sampling,
        )
        self.num_fragments = num_fragments
        self._fragments: list[Block] = []
        #: The tensors the fragments split by rows, with their slices (``blocks.row_slices``).
        self._slices: dict[str, list[tuple[str, int, int]]] = {}
        #: Per client id, the last round whose result was aggregated (see the module docstring).
        self._last_round: dict[str, int] = {}
        #: The fragments a round changed besides its own (late results merged into theirs), for
        #: the last F rounds: a client's download takes them too (``synced_since``).
        self._also_changed: dict[int, tuple[int, ...]] = {}

    def initialize(self, *, initial_state: ModelState) -> None:
        self._fragments = self._fragments_of(initial_state)
        self._slices = row_slices(self._fragments)
        super().initialize(initial_state=initial_state)
        self._last_round = {}
        self._also_changed = {}

    def _fragments_of(self, state: ModelState) -> list[Block]:
        """The fragments of a model (``default_blocks`` with row slices).

        Raises:
            ConfigError: (key ``num_fragments``) the model has fewer tensors (or rows) than fragments.
        """
        try:
            return default_blocks(TensorSpec.of(state), self.num_fragments, split_rows=True)
        except ValueError as exc:  # the model is known only now: still a configuration error
            raise ConfigError("num_fragments", str(exc)) from None

    def downlink_state(self, *, server_round: int) -> ModelState:
        """The global model, each tensor the fragments split as its row slices
        (``blocks.sliced_state``); the global model itself when none is split."""
        return sliced_state(self.global_state, self._slices)

    @property
    def fragments(self) -> list[Block]:
        """The fragments, in model order (set by ``initialize``)."""
        if not self._fragments:
            raise RuntimeError("strategy has no global model: call initialize() first")
        return self._fragments

    def fragment_of_round(self, server_round: int) -> Block:
        """The fragment synced in ``server_round``: number ``server_round % F``."""
        return self.fragments[server_round % self.num_fragments]

    def synced_since(self, client: ClientInfo, server_round: int) -> list[Block] | None:
        """The fragments synced since ``client``'s last aggregated round, in model order.

        ``None`` when the strategy has no record of the client, or every fragment was synced
        since (the client then needs the whole model).
        """
        last = self._last_round.get(client.client_id)
        if last is None or not 0 < server_round - last < self.num_fragments:
            return None
        # Rounds last .. server_round - 1 each synced their fragment, and the fragments of the late
        # results they merged; the client merged none of them.
        synced = {
            f
            for r in range(last, server_round)
            for f in (r % self.num_fragments, *self._also_changed.get(r, ()))
        }
        if len(synced) == self.num_fragments:
            return None
        return [f for f in self.fragments if f.index in synced]

    def configure_round(
        self, *, server_round: int, clients: Sequence[ClientInfo]
    ) -> list[tuple[ClientInfo, FitIns]]:
        fragment = self.fragment_of_round(server_round)
        config = {
            **self._task_config(server_round),
            "fragment": fragment.index,
            "merge_fragment": (server_round - 1) % self.num_fragments,
            "num_fragments": self.num_fragments,
            "fragment_prefixes": ",".join(fragment.prefixes),
        }
        specs = TensorSpec.of(self.downlink_state(server_round=server_round))
        expected = OrderedDict((n, specs[n]) for n in fragment.names)
        tasks: dict[tuple[int, ...] | None, FitIns] = {}  # clients that missed the same rounds share a task
        out: list[tuple[ClientInfo, FitIns]] = []
        for client in self.sampling.fit_clients(clients, server_round):
            synced = self.synced_since(client, server_round)
            key = None if synced is None else tuple(f.index for f in synced)
            if key not in tasks:
                merge = self.fragments if synced is None else synced
                tasks[key] = FitIns(
                    round=server_round,
                    config={
                        **config,
                        "merge_fragment_prefixes": ",".join(p for f in merge for p in f.prefixes),
                    },
                    expected=expected,
                    download=None if synced is None else tuple(n for f in synced for n in f.names),
                )
            out.append((client, tasks[key]))
        return out

    def aggregate(
        self, *, server_round: int, results: Sequence[FitRes], failures: Sequence[Failure]
    ) -> dict[str, float]:
        """The outer step of round ``server_round``'s fragment on its results, and of each other
        fragment that late results of a semi-asynchronous round carry (``FitRes.task_round``:
        a late result holds its task round's fragment, as a difference from that task's model).

        A fragment's results enter one weighted mean, the late ones with their staleness weight
        (``fedgrid.aggregation.staleness``), as in every quorum round. A fragment that only late
        results carry moves by ``sum(weight * difference) / sum(num_examples)``: their mean
        discounted by their staleness, since no fresh result weighs against them (a result
        ``s`` rounds stale moves it by ``(1 + s) ** -a`` of its difference). One server step
        takes every fragment's pseudo-gradient, each with its own outer momentum.
        """
        for failure in failures:  # it may have lost its replica: the whole model next time
            self._last_round.pop(failure.client.client_id, None)
        for result in results:  # a late result: the client's replica is its task round's
            task_round = server_round if result.task_round is None else result.task_round
            cid = result.client.client_id
            self._last_round[cid] = max(self._last_round.get(cid, task_round), task_round)
        # Bounded memory: a client absent for F rounds needs the whole model, as one without a record.
        self._last_round = {
            cid: r for cid, r in sorted(self._last_round.items()) if server_round + 1 - r < self.num_fragments
        }
        self._also_changed = {
            r: f for r, f in self._also_changed.items() if server_round + 1 - r < self.num_fragments
        }
        if not results:
            return {}
        ordered = sorted(results, key=lambda r: r.client.sort_key)
        own = self.fragment_of_round(server_round).index
        by_fragment: dict[int, list[FitRes]] = {}
        for result in ordered:
            task_round = server_round if result.task_round is None else result.task_round
            by_fragment.setdefault(task_round % self.num_fragments, []).append(result)
        metrics = {**train_metrics(ordered), "fragment": float(own)}
        sliced = self.downlink_state(server_round=server_round)
        groups = []
        for index in sorted(by_fragment, key=lambda i: (i != own, i)):  # its own fragment first
            group = by_fragment[index]
            scale = 1.0
            if index != own:
                scale = sum(r.mean_weight for r in group) / sum(float(r.num_examples) for r in group)
            groups.append((self.fragments[index].names, group, scale))
        self._begin_aggregation(server_round)
        try:
            update = self._update_parts(groups, state=sliced)
        except AggregationPreconditionError:
            return {**metrics, "aggregation_skipped": 1.0}
        late_fragments = tuple(sorted(i for i in by_fragment if i != own))
        if late_fragments:
            self._also_changed[server_round] = late_fragments
            metrics["late_fragments"] = float(len(late_fragments))
        state = OrderedDict((n, update.get(n, t)) for n, t in self.global_state.items())
        for name, parts in self._slices.items():  # a split tensor synced: its rows updated, a new tensor
            if any(part in update for part, _, _ in parts):
                state[name] = torch.cat([update.get(part, sliced[part]) for part, _, _ in parts])
        self._state = state
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "num_fragments": self.num_fragments,
            "last_round": dict(self._last_round),
            "also_changed": {r: list(f) for r, f in self._also_changed.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what ``state_dict`` returned; a checkpoint without ``last_round`` (older
        than it) gives every client the whole model next round.

        Raises:
            ValueError: another number of fragments, or a malformed ``last_round``.
        """
        if int(state.get("num_fragments", self.num_fragments)) != self.num_fragments:
            raise ValueError(
                f"checkpoint has {state['num_fragments']} fragments, this strategy {self.num_fragments}"
            )
        try:
            last_round = {str(cid): int(r) for cid, r in dict(state.get("last_round", {})).items()}
        except (TypeError, ValueError) as exc:
            raise ValueError(f"checkpoint's last_round is not a map of client id to round: {exc}") from None
        try:
            also_changed = {
                int(r): tuple(int(i) for i in f) for r, f in dict(state.get("also_changed", {})).items()
            }
        except (TypeError, ValueError) as exc:
            raise ValueError(f"checkpoint's also_changed is not a map of round to fragments: {exc}") from None
        super().load_state_dict(self._with_sliced_buffers(state))
        self._last_round = last_round
        self._also_changed = also_changed

    def _with_sliced_buffers(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """``state`` with the outer optimizer's buffers of each tensor its model's fragments split
        (kept per row slice) cut into those slices: a checkpoint written before fragments could
        split a tensor holds them whole. Elementwise optimizers make the two the same state."""
        optimizer, model = state.get("server_optimizer"), state.get("global_state")
        if (
            not isinstance(optimizer, Mapping)
            or not isinstance(optimizer.get("buffers"), Mapping)
            or model is None
        ):
            return state  # the checks of load_state_dict name what is wrong
        slices = row_slices(self._fragments_of(model))
        if not slices:
            return state

        def cut(per: Any) -> Any:
            if not isinstance(per, Mapping):
                return per
            out: dict[str, Any] = {}
            for name, tensor in per.items():
                if name in slices:
                    out.update((part, tensor[start:stop].clone()) for part, start, stop in slices[name])
                else:
                    out[name] = tensor
            return out

        buffers = {kind: cut(per) for kind, per in optimizer["buffers"].items()}
        return {**state, "server_optimizer": {**optimizer, "buffers": buffers}}
