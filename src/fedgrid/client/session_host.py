"""What an embedding session (``fedgrid.client.session``) and its host program hand each other.

The session hands the host a ``Task`` per coordinator task; the host may hand the session a
``MessageHandler`` (message phases) and an ``ErrorHook`` (what did not land). ``SessionMember`` is
the ``Client`` the session's ``TaskFeed`` joins as: it tells the coordinator the host's name,
region and examples, and routes message phases to the host's handler. ``tell`` is how the
session talks to the person running the host program: a line per task, heard by default.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Mapping, Protocol

from fedgrid.client.api import Client, FitOutput
from fedgrid.client.task_feed import TaskReport
from fedgrid.types import EvaluateIns, FitIns, MessageIns, ModelState, Scalar

__all__ = ["Task", "MessageHandler", "ErrorHook", "SessionMember", "tell", "task_line"]

log = logging.getLogger("fedgrid.client.session")


def task_line(report: TaskReport) -> str:
    """One finished task as a line: round, kind, examples, loss, bytes moved."""
    loss = "" if report.loss is None else f", loss {report.loss:.4f}"
    retries = f", {report.upload_retries} upload retries" if report.upload_retries else ""
    return (
        f"round {report.round}: {report.kind} result sent ({report.num_examples} examples{loss}; "
        f"{report.bytes_down / 1e3:.1f} kB down, {report.bytes_up / 1e3:.1f} kB up{retries})"
    )


def tell(line: str) -> None:
    """``line`` for the person running the host program. A program that configured logging
    gets it at INFO from ``fedgrid.client.session`` (its levels and handlers decide); one that
    did not, where Python would drop an INFO record, gets it on stderr: the session is never
    silent while it trains (``connect(..., verbose=False)`` turns it off)."""
    if log.hasHandlers():
        log.info("%s", line)
    else:
        print(f"fedgrid session: {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Task:
    """One task for the host program: train (``kind == "fit"``) or evaluate the global model.

    Attributes:
        round: the coordinator's round.
        kind: ``fedgrid.types.FIT`` or ``fedgrid.types.EVALUATE``.
        state: the global model. Read it (``load_state_dict`` copies); never change it in
            place: lossy uplinks send the difference to it, and a compressed downlink applies
            the next round's difference to it.
        config: the scalars the strategy sent (``lr``, ``local_epochs``, ``uplink_codec``, ...).
        ins: the same as the ``FitIns`` (fit) or ``EvaluateIns`` (evaluate) a ``Client`` gets.
        deadline_s: seconds the coordinator gives the task from when it was sent.
        task_id: the coordinator's id of the task.
    """

    round: int
    kind: str
    state: ModelState
    config: Mapping[str, Scalar]
    ins: FitIns | EvaluateIns
    deadline_s: float
    task_id: str


class MessageHandler(Protocol):
    """Takes part in a strategy's message phases (a ``fedgrid.client.Client`` is one):
    ``exchange`` returns the messages to send, ``receive`` gets those relayed back."""

    def exchange(self, ins: MessageIns) -> Mapping[str, bytes]: ...

    def receive(self, ins: MessageIns, inbox: Mapping[str, bytes]) -> None: ...


class ErrorHook(Protocol):
    """``on_error``: what went wrong, and the task it concerned (``None``: the session's end)."""

    def __call__(self, *, error: BaseException, task: Task | None) -> None: ...


class SessionMember(Client):
    """What Join tells the coordinator about the session; message phases go to ``messages``."""

    def __init__(
        self,
        name: str,
        region: str,
        num_examples: int,
        messages: MessageHandler | None,
        *,
        base_hash: str = "",
        lora_rank: int = 0,
    ) -> None:
        self.name, self.region, self._num_examples, self._messages = name, region, num_examples, messages
        self._adapters = (base_hash, lora_rank)

    @property
    def base_hash(self) -> str:
        """The host's frozen base model's hash (``Client.base_hash``), shown at Join."""
        return self._adapters[0]

    @property
    def lora_rank(self) -> int:
        """The rank of the host's LoRA adapters (``Client.lora_rank``; 0: none), announced at Join."""
        return self._adapters[1]

    @property
    def num_examples(self) -> int:
        return self._num_examples

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        raise NotImplementedError("a session's fit tasks go to its host program")  # TaskFeed never calls it

    def exchange(self, ins: MessageIns) -> Mapping[str, bytes]:
        if self._messages is None:  # TaskFeed reports this as the phase's failure, naming the phase
            raise NotImplementedError(
                f"this session has no handler for message phase {ins.phase!r}: "
                "pass connect(..., messages=...) an object with exchange() and receive()"
            )
        return self._messages.exchange(ins)

    def receive(self, ins: MessageIns, inbox: Mapping[str, bytes]) -> None:
        if self._messages is not None:
            self._messages.receive(ins, inbox)
