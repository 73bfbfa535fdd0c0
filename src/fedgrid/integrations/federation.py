"""The trainer-agnostic half of the callbacks: a trainer that owns its loop takes part in a federation
through one embedding session (``fedgrid.client.connect``), on the coordinator's cadence.

``Federation`` is what a callback calls at three points of its trainer's loop::

    federation.begin(model, steps_per_epoch=..., examples_per_step=..., num_examples=...)  # train begin
    federation.after_backward()                  # before each optimizer step (FedProx, SCAFFOLD)
    if not federation.step(loss=...):            # after each optimizer step
        stop training                            # the coordinator's run is over
    federation.end()                             # train end

``begin`` joins and pulls the global model (a ``PeftModel``'s adapters only: ``wire_model``); each
``step`` counts optimizer steps, and once the round's count is reached (``Loop``: DiLoCo's
``inner_steps``, FedAvg's ``local_epochs`` of the trainer's epoch, or ``steps_per_round``) the
model goes up and the next global model comes down. The task's algorithm (``algorithm`` key)
decides what is loaded and what is sent, through the same ``ClientAlgorithm`` hooks
``TorchClient`` calls (``fedgrid.client.algorithms``): DiLoCo's merge into a replica, streaming
DiLoCo's fragments, overlapped syncs (``sync_delay_steps``: the upload goes in the background and
the trainer trains tau more steps before the merge). The trainer's own optimizer is the inner
optimizer, kept across rounds; its learning rate and schedule are the trainer's.

Under several processes (DDP: ``accelerate launch``, Lightning's ``ddp``) only rank 0 holds the
session; it broadcasts what it receives (the task, the run's end, or its error) and every rank
loads the same state, so the ranks agree. ``end`` merges the newest global model that came after
the last upload (the final aggregate, when the coordinator asks clients to evaluate it:
``fraction_evaluate``) and leaves; a round cut short by the trainer's own end is reported failed
and the model goes back to that round's global model.
"""

from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol

import torch
from torch import nn

from fedgrid.client.algorithms import ALGORITHMS, ClientAlgorithm, FitContext, algorithm_of
from fedgrid.client.api import EvaluateOutput, FitOutput
from fedgrid.client.session import Session, Task, connect
from fedgrid.errors import SessionError
from fedgrid.types import EVALUATE, ModelState

__all__ = ["JoinOptions", "Connector", "TaskSession", "Federation", "connector", "wire_model"]

log = logging.getLogger(__name__)


class Pending(Protocol):
    """A fit result on its way (``Session.submit_nowait``'s ``Delivery``)."""

    def wait(self, timeout: float | None = None) -> Any: ...


class TaskSession(Protocol):
    """What ``Federation`` asks of a session: ``fedgrid.client.Session``'s part it calls. A
    deployed client's is a ``Session`` (gRPC); a simulated one's hands the tasks over in this
    process (``fedgrid.integrations.simulated``): the two differ in transport only."""

    rounds: int

    def open(self) -> Any: ...

    def tasks(self) -> Iterator[Task]: ...

    def submit(self, result: FitOutput | EvaluateOutput) -> Any: ...

    def submit_nowait(self, result: FitOutput) -> Pending: ...

    def report_failure(self, reason: str) -> None: ...

    def close(self, reason: str = ...) -> None: ...


class Connector(Protocol):
    """Who the client is and the session it opens: ``JoinOptions`` (over gRPC), or a simulated
    client's handoff (``fedgrid.integrations.simulated``)."""

    @property
    def name(self) -> str: ...

    def session(self, *, num_examples: int, base_hash: str, lora_rank: int) -> TaskSession: ...


@dataclass(frozen=True)
class JoinOptions:
    """How a callback reaches its coordinator: ``fedgrid client``'s options.

    Attributes:
        coordinator: ``HOST:PORT``.
        name: stable label sent at join (under mutual TLS the certificate names the client).
        region: region label sent at join.
        ca, cert, key: PEM files for mutual TLS (all three or none).
        server_name: the name the coordinator's certificate holds, when not the host.
        state_dir: saves the uplink's error-feedback residuals to ``DIR/client-NAME.pt`` after
            every round and resumes from them (``fedgrid client --state-dir``).
        options: more of ``fedgrid.client.connect``'s options (``connect_timeout``,
            ``rpc_timeout``, ``poll_wait_s``, ``verbose``, ``on_task``, ...).
    """

    coordinator: str
    name: str = ""
    region: str = ""
    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""
    state_dir: str | os.PathLike[str] | None = None
    options: Mapping[str, Any] | None = None

    def session(self, *, num_examples: int, base_hash: str, lora_rank: int) -> Session:
        """The session this connection opens (not joined yet)."""
        state_path = (
            None if self.state_dir is None else Path(self.state_dir) / f"client-{self.name or 'session'}.pt"
        )
        return connect(
            self.coordinator,
            name=self.name,
            region=self.region,
            ca=self.ca,
            cert=self.cert,
            key=self.key,
            server_name=self.server_name,
            state_path=state_path,
            num_examples=num_examples,
            base_hash=base_hash,
            lora_rank=lora_rank,
            **dict(self.options or {}),
        )


def connector(coordinator: "str | Connector", **options: Any) -> Connector:
    """A callback's connection: ``JoinOptions(coordinator, **options)`` for a ``HOST:PORT``; a
    ``Connector`` as it is (a simulated client's, which names the client itself).

    Raises:
        ValueError: a ``Connector`` given connection options too (they would be ignored).
    """
    if isinstance(coordinator, str):
        return JoinOptions(coordinator, **options)
    given = sorted(k for k, v in options.items() if v not in ("", None, {}))
    if given:
        raise ValueError(
            f"a simulated client's connection takes no connection options (got {', '.join(given)}): "
            "its TrainerClient names the client"
        )
    return coordinator


def wire_model(model: nn.Module, prefix: str = "net.") -> nn.Module:
    """``model`` as the coordinator names it: a ``PeftModel`` as ``--model hf:PATH --peft lora:...``
    builds it (``fedgrid.simulation.peft_lm.PeftLM``: its state is the adapters, under ``net.``, and
    its ``base_hash`` is that of the frozen rest), any other module under ``prefix`` (``net.``: as
    ``--model hf:PATH`` names a Hugging Face model's tensors; ``""``: as they are).

    The returned module holds ``model`` (no copy): loading into it loads into ``model``."""
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, Mapping) and peft_config:
        from fedgrid.config_llm import LoraSpec
        from fedgrid.simulation.peft_lm import PeftLM

        config = next(iter(peft_config.values()))
        targets = config.target_modules
        spec = LoraSpec(
            r=int(config.r),
            alpha=float(config.lora_alpha),
            targets=(targets,) if isinstance(targets, str) else tuple(sorted(targets)),
            dropout=float(config.lora_dropout),
        )
        if prefix != "net.":
            raise ValueError(
                f"a PeftModel is named under 'net.' (as the coordinator's --peft builds it), not {prefix!r}"
            )
        return PeftLM(model, spec)
    if not prefix:
        return model
    if not prefix.endswith("."):
        raise ValueError(f"prefix must end with '.', got {prefix!r}")
    wrapper = nn.Module()
    holder = wrapper
    parts = prefix[:-1].split(".")
    for part in parts[:-1]:
        inner = nn.Module()
        holder.add_module(part, inner)
        holder = inner
    holder.add_module(parts[-1], model)
    return wrapper


def _distributed() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class Federation:
    """One client of a federation driven by a trainer's callback (the module's docstring).

    Args:
        connection: how to reach the coordinator and who this client is (``JoinOptions``; a
            simulated client's ``Connector``).
        prefix: the model's names on the wire (``wire_model``).
        steps_per_round: optimizer steps of a FedAvg round (a task with ``local_epochs``); 0:
            ``local_epochs`` times the trainer's steps per epoch. A DiLoCo task's
            ``inner_steps`` always decides.
        num_examples: training examples held, reported at join; 0: what the trainer holds.
    """

    def __init__(
        self,
        connection: Connector,
        *,
        prefix: str = "net.",
        steps_per_round: int = 0,
        num_examples: int = 0,
    ) -> None:
        if steps_per_round < 0:
            raise ValueError(f"steps_per_round must be at least 0, got {steps_per_round}")
        if num_examples < 0:
            raise ValueError(f"num_examples must be at least 0, got {num_examples}")
        self.connection, self.prefix = connection, prefix
        self.steps_per_round, self.num_examples = steps_per_round, num_examples
        self.rank, self.world = 0, 1
        self.session: TaskSession | None = None
        self.finished = False
        #: Rounds this client's result landed in (rank 0's count, broadcast to every rank).
        self.rounds = 0
        self._wire: nn.Module | None = None
        self._names: tuple[str, ...] = ()
        self._algorithms: dict[str, ClientAlgorithm] = {}
        self._tasks: Iterator[Task] | None = None
        self._task: _FitTask | None = None
        self._pending: Pending | None = None
        self._latest: ModelState | None = None  # a global model newer than the last upload
        self._steps = self._lookahead_left = 0
        self._steps_per_epoch = self._examples_per_step = 0
        self._loss_sum, self._loss_count = 0.0, 0

    # -- the trainer's three points ---------------------------------------------------------
    def begin(
        self, model: nn.Module, *, steps_per_epoch: int, examples_per_step: int, num_examples: int
    ) -> None:
        """Joins (rank 0) and loads the first round's global model into ``model`` (every rank).

        Args:
            model: the trainer's model (unwrapped: not its DDP wrapper).
            steps_per_epoch: the trainer's optimizer steps per epoch (FedAvg's rounds).
            examples_per_step: examples one optimizer step trains on, all ranks together.
            num_examples: training examples the trainer holds (used unless ``num_examples`` was given).

        Raises:
            BaseModelMismatchError, RpcFailed: the Join was refused (a coordinator of another
                base model names both hashes).
            SessionError: the run was over before a round was sent.
        """
        self.rank, self.world = _distributed()
        self._wire = wire_model(model, self.prefix)
        self._names = tuple(self._wire.state_dict())
        self._steps_per_epoch, self._examples_per_step = max(steps_per_epoch, 1), max(examples_per_step, 1)
        held = self.num_examples or num_examples
        if held < 1:
            raise ValueError(
                "the trainer's training set has no length: pass num_examples= (the examples this site holds)"
            )
        if self.rank == 0:
            self.session = self.connection.session(
                num_examples=held,
                base_hash=str(getattr(self._wire, "base_hash", "")),
                lora_rank=int(getattr(getattr(self._wire, "spec", None), "r", 0)),
            )
            try:
                self.session.open()  # closes itself when the Join fails
            except BaseException as exc:
                self.session = None
                self._tell_ranks(exc)
                raise
            self._tasks = self.session.tasks()
        self.num_examples = held
        if not self._next_round(first=True):
            raise SessionError("the coordinator's run was over before it sent this client a round")

    def after_backward(self) -> None:
        """Before the optimizer's step: the algorithm's ``after_backward`` (FedProx's term, SCAFFOLD's correction)."""
        if self._task is not None and self._lookahead_left == 0:
            self._task.algorithm.after_backward(params=self._task.params)

    def step(self, loss: float | None = None) -> bool:
        """After an optimizer step: syncs when the round's steps are done. Returns ``False``
        once the coordinator's run is over (the trainer stops)."""
        if self._task is None:
            return not self.finished
        if loss is not None and math.isfinite(loss):
            self._loss_sum, self._loss_count = self._loss_sum + loss, self._loss_count + 1
        if self._lookahead_left > 0:  # overlapped DiLoCo: training while the upload travels
            self._lookahead_left -= 1
            self._steps += 1
            return self._lookahead_left > 0 or self._next_round()
        self._steps += 1
        if self._steps < self._task.steps:
            return True
        self._upload()
        if self._lookahead_left > 0:
            self._steps = 0
            return True
        self._steps = 0
        return self._next_round()

    def end(self) -> None:
        """Merges the newest global model and leaves. A round the trainer cut short is reported
        failed (rank 0) and the model goes back to that round's global model; one whose upload
        is on its way (overlapped DiLoCo) is waited for, and the model stays as trained."""
        try:
            task, self._task = self._task, None
            if task is not None and not self.finished:
                if self._lookahead_left > 0:
                    if self._pending is not None:
                        self._pending.wait()
                else:
                    if self.session is not None:
                        self.session.report_failure(
                            f"the trainer stopped after {self._steps} of round {task.round}'s {task.steps} steps"
                        )
                    self._latest = task.start
            if self._latest is not None and self._wire is not None:
                self._wire.load_state_dict(self._latest)
        finally:
            self._latest, self._pending = None, None
            if self.session is not None:
                self.session.close("the trainer finished")
                self.session = None

    # -- inside ----------------------------------------------------------------------------
    def _trainable(self) -> dict[str, nn.Parameter]:
        assert self._wire is not None
        return {n: p for n, p in self._wire.named_parameters() if p.requires_grad}

    def _state(self) -> ModelState:
        assert self._wire is not None
        return OrderedDict((n, t.detach().to("cpu").clone()) for n, t in self._wire.state_dict().items())

    def _upload(self) -> None:
        """The round's result goes up (rank 0): at once, or in the background for overlapped DiLoCo."""
        task = self._task
        assert task is not None
        trained = self._state()
        upload = task.algorithm.upload(state=trained, trained=list(trained), ctx=task.ctx)
        # Examples trained on, at most those held (a round of several epochs): the update's weight.
        examples = max(1, min(self._steps * self._examples_per_step, self.num_examples))
        metrics = {"loss": self._loss_sum / self._loss_count} if self._loss_count else {}
        self._loss_sum, self._loss_count = 0.0, 0
        result = FitOutput(upload, num_examples=examples, metrics=metrics)
        self._lookahead_left = task.lookahead
        if self.session is None:
            return
        if task.lookahead > 0:
            self._pending = self.session.submit_nowait(result)
        else:
            self.session.submit(result)

    def _receive(self) -> tuple[str, Any]:
        """Rank 0: the next fit task (evaluate tasks answered on the way, their model kept as the
        newest), or the run's end."""
        assert self.session is not None and self._tasks is not None
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()
        for task in self._tasks:
            if task.kind == EVALUATE:
                self._latest = OrderedDict(task.state)
                self.session.submit(EvaluateOutput(num_examples=0))
                continue
            return "fit", (task.round, dict(task.config), OrderedDict(task.state))
        return "finished", self._latest  # every rank merges the final aggregate, when it came

    def _tell_ranks(self, exc: BaseException) -> None:
        """Rank 0 failed: the other ranks, waiting for what it receives, raise too instead of hanging."""
        if self.world > 1:
            torch.distributed.broadcast_object_list([("error", f"{type(exc).__name__}: {exc}", 0)], src=0)

    def _next_round(self, first: bool = False) -> bool:
        """Takes the next round (rank 0 receives, every rank gets it) and loads its start state;
        ``False`` when the run is over."""
        message: list[Any] = [None]
        if self.rank == 0:
            try:
                kind, body = self._receive()
            except BaseException as exc:
                self._tell_ranks(exc)
                raise
            message[0] = (kind, body, self.session.rounds if self.session is not None else 0)
        if self.world > 1:
            torch.distributed.broadcast_object_list(message, src=0)
        kind, body, self.rounds = message[0]
        if kind == "error":
            raise SessionError(f"rank 0 lost the coordinator: {body}")
        if kind == "finished":
            self.finished, self._task, self._latest = True, None, body
            return False
        round_, config, download = body
        self._latest = None
        self._task = self._start(round_, config, download, resume=not first)
        return True

    def _start(
        self, round_: int, config: dict[str, Any], download: ModelState, *, resume: bool
    ) -> "_FitTask":
        assert self._wire is not None
        name = algorithm_of(config)
        algorithm = self._algorithms.get(name)
        if algorithm is None:
            algorithm = self._algorithms[name] = ALGORITHMS[name]()
        ctx = FitContext(config=config, model=self._names, client=self.connection.name)
        loop = algorithm.loop(ctx=ctx)
        lookahead = algorithm.lookahead(ctx=ctx)
        if resume and lookahead > 0:
            algorithm.resume(state=self._state())
        trains = algorithm.trained(names=list(self._names), ctx=ctx)
        if list(trains) != list(self._names):
            raise ValueError(
                f"algorithm {name!r} trains {len(trains)} of the model's {len(self._names)} tensors; "
                "a trainer's callback trains the whole model (use TorchClient for it)"
            )
        start = algorithm.start(download=download, ctx=ctx)
        self._wire.load_state_dict(start)
        # Built once a round, not at every step: the same parameters (loading copies into them),
        # and naming them costs ~0.1 ms on a small model, 2-4% of a tiny Llama's 4 ms step.
        params = self._trainable()
        algorithm.begin(params=params, ctx=ctx)
        steps = (
            loop.steps if loop.steps > 0 else loop.epochs * (self.steps_per_round or self._steps_per_epoch)
        )
        # Overlapped DiLoCo: the tau steps trained after the upload count toward this round.
        first_steps = steps - lookahead if resume and lookahead > 0 else steps
        self._steps = steps - first_steps
        return _FitTask(round_, ctx, algorithm, steps, lookahead, start, params)


@dataclass(frozen=True)
class _FitTask:
    round: int
    ctx: FitContext
    algorithm: ClientAlgorithm
    steps: int
    lookahead: int
    start: ModelState | None
    params: dict[str, nn.Parameter]
