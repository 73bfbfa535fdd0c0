"""What an embedding session (``fedgrid.client.session``) and its host program hand each other.

The host hands the session its ``SessionOptions`` (who it is, its TLS files, its hooks); the
session hands the host a ``Task`` per coordinator task; the host may hand the session a
``MessageHandler`` (message phases) and an ``ErrorHook`` (what did not land). ``SessionMember`` is
the ``Client`` the session's ``TaskFeed`` joins as: it tells the coordinator the host's name,
region and examples, and routes message phases to the host's handler. ``tell`` is how the
session talks to the person running the host program: a line per task, heard by default.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from fedgrid.client.api import Client, FitOutput
from fedgrid.client.task_feed import TaskReport
from fedgrid.constants import POLL_WAIT_S
from fedgrid.types import EvaluateIns, FitIns, MessageIns, ModelState, Scalar

__all__ = ["Task", "MessageHandler", "ErrorHook", "SessionMember", "SessionOptions", "tell", "task_line"]

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


@dataclass(frozen=True)
class SessionOptions:
    """What a host program tells its ``Session`` (``connect``'s keywords).

    Attributes:
        name: stable label sent at join (under mutual TLS the certificate names the client).
        region: region label sent at join.
        num_examples: training examples held (reported at join; used by selection).
        ca, cert, key: PEM files for mutual TLS (all three or none), as ``run`` takes them.
        server_name: the name the coordinator's certificate holds, when not the host of the
            coordinator's address.
        poll_wait_s: longest long poll; ``close`` from another thread ends one at once.
        evaluate: hand evaluate tasks to the host program. ``False``: the session answers
            them itself with zero examples, as ``run`` does for a client without ``evaluate``.
        state_path: where the uplink's error-feedback residuals are saved after every fit
            task and restored from at ``open`` (``run``'s ``state_path``). ``None``: memory only.
        messages: takes part in message phases; without it a message phase is reported
            failed, naming the phase.
        on_task: called with a ``TaskReport`` after each upload that landed (``run``'s
            ``on_task``: ``fedgrid.client.monitor.ClientMonitor.on_task`` fits).
        on_error: called with ``error=`` and ``task=`` for what did not land (a non-finite
            result, refused here and reported as the round's failure; an update the round
            closed before) and for the error that ends the session (``task`` is then the
            unanswered task, if any). Called on the thread that made the call.
        verbose: a line at the join and one per task that landed (round, kind, examples, loss,
            bytes): at INFO of ``fedgrid.client.session`` where the program configured logging,
            else on stderr (``tell``). ``False``: none.
        base_hash: the hash of the frozen base model the host trains adapters on, shown at Join
            (a coordinator of another base refuses the session, naming both hashes;
            ``fedgrid.integrations.federation.wire_model`` computes it for a ``PeftModel``).
        lora_rank: the rank of those adapters, announced at Join (0: none).
        connection: passed to ``Connection`` (``connect_timeout``, ``rpc_timeout``, ...).
    """

    name: str = ""
    region: str = ""
    num_examples: int = 0
    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""
    poll_wait_s: float = POLL_WAIT_S
    evaluate: bool = True
    state_path: str | os.PathLike[str] | None = None
    messages: MessageHandler | None = None
    on_task: Callable[[TaskReport], None] | None = None
    on_error: ErrorHook | None = None
    verbose: bool = True
    base_hash: str = ""
    lora_rank: int = 0
    connection: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, **options: Any) -> "SessionOptions":
        """The options of ``connect(coordinator, **options)``: its keywords named here are the
        fields, the others go to ``Connection`` (``connection``)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"connection"}
        return cls(
            **{k: v for k, v in options.items() if k in names},
            connection={k: v for k, v in options.items() if k not in names},
        )
