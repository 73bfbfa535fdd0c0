"""The ``Fleet`` seam: how the round engine reaches clients.

``RemoteFleet`` (``server/remote_fleet.py``) reaches real clients over the network; the
simulation fleets run them in process. The engine, strategies and codecs never know which.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, Mapping, Sequence, TypeVar

from fedgrid.types import (
    ClientInfo,
    EvaluateIns,
    EvaluateRes,
    Failure,
    FitIns,
    FitRes,
    MessageIns,
    MessageRes,
    ModelState,
)

__all__ = ["Fleet", "RoundOutcome", "Quorum", "LateResult", "quorum_of", "QUORUM_NEEDS_REPLAY"]

#: Why a simulated fleet refuses quorum rounds (``ConfigError`` of key ``min_quorum``).
QUORUM_NEEDS_REPLAY = (
    "fedgrid simulate runs quorum rounds only as the replay of a deployment's record "
    "(arrival times decide them): pass replay = RUN_DIR/events.jsonl"
)

if TYPE_CHECKING:
    from fedgrid.config import Config


R = TypeVar("R", FitRes, EvaluateRes, MessageRes)


@dataclass(frozen=True)
class Quorum:
    """Semi-asynchronous fit rounds (FedBuff-style; docs/failures.rst, "Quorum rounds").

    A round closes once ``min_quorum`` of its selected clients have reported, ``grace_s``
    after that, or when all have (whichever first; the deadline still applies). The others
    keep their task: they are busy (not selected again) until they report or its deadline
    passes, and their result is merged into the round open when it lands, or the next one.

    Args:
        min_quorum: K, results a round closes at (at least 1).
        grace_s: seconds the round stays open after its quorum, for more results.
        max_staleness: S; a late result whose merging round is more than S rounds after its
            task's round is refused (``StaleTaskError`` naming both numbers).
        staleness_exponent: a, of the weight ``num_examples * (1 + s) ** -a``.

    Raises:
        ValueError: a value out of range (``Config`` names the keys first).
    """

    min_quorum: int
    grace_s: float = 0.0
    max_staleness: int = 4
    staleness_exponent: float = 0.5

    def __post_init__(self) -> None:
        if self.min_quorum < 1:
            raise ValueError(f"min_quorum must be at least 1, got {self.min_quorum}")
        if not 0.0 <= self.grace_s < float("inf") or self.max_staleness < 0 or self.staleness_exponent < 0:
            raise ValueError(
                f"grace_s, max_staleness and staleness_exponent must be at least 0, got {self.grace_s}, "
                f"{self.max_staleness} and {self.staleness_exponent}"
            )

    def refusal(self, *, task_round: int, merge_round: int) -> str | None:
        """Why a result of ``task_round`` cannot be merged into ``merge_round``, or ``None``."""
        staleness = merge_round - task_round
        if staleness > self.max_staleness:
            return (
                f"result of round {task_round} is {staleness} rounds stale; "
                f"max_staleness is {self.max_staleness}"
            )
        return None


def quorum_of(config: "Config") -> Quorum | None:
    """The semi-asynchronous rounds ``config`` asks for (``min_quorum``), or ``None``."""
    if not config.min_quorum:
        return None
    return Quorum(
        min_quorum=config.min_quorum,
        grace_s=config.grace_s,
        max_staleness=config.max_staleness,
        staleness_exponent=config.staleness_exponent,
    )


@dataclass(frozen=True)
class LateResult:
    """A result that landed after its round closed at its quorum, to be merged into a later round.

    Attributes:
        result: as accepted (values, or differences from ``base`` when ``result.delta``).
        task_round: the round of its task.
        base: the model its task sent (``Strategy.downlink_state`` of ``task_round``).
    """

    result: FitRes
    task_round: int
    base: ModelState


@dataclass(frozen=True)
class RoundOutcome(Generic[R]):
    """What came back from a round: results, failures (as data), clients cancelled because
    the round reached its target first (over-selection), the bytes moved, and why the
    round closed (``closed_by``: ``all``, ``target``, ``quorum``, ``deadline`` or
    ``stopping``, see ``fedgrid.events``). Under a ``Quorum``: ``late``, the results of
    earlier rounds' tasks that landed since the last fit round closed, and ``waiting``, the
    clients of this round it closed without (they keep their task)."""

    results: list[R]
    failures: list[Failure]
    cancelled: list[ClientInfo] = field(default_factory=list)
    bytes_up: int = 0
    bytes_down: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    closed_by: str = "all"
    late: list[LateResult] = field(default_factory=list)
    waiting: list[ClientInfo] = field(default_factory=list)


class Fleet(ABC):
    """A set of clients the engine can hand tasks to."""

    @abstractmethod
    def wait_for_clients(self, *, min_clients: int, timeout: timedelta) -> list[ClientInfo]:
        """Blocks until at least ``min_clients`` are live; returns the live clients.

        Raises:
            TimeoutError: fewer than ``min_clients`` were live when ``timeout`` passed.
        """

    @abstractmethod
    def fit_round(
        self,
        *,
        server_round: int,
        global_state: ModelState,
        assignments: Sequence[tuple[ClientInfo, FitIns]],
        timeout: timedelta,
        target: int | None = None,
        quorum: Quorum | None = None,
    ) -> RoundOutcome[FitRes]:
        """Sends ``global_state`` and each client's task, returns by ``timeout`` at the latest,
        or as soon as ``target`` results have arrived (default: all assigned).

        A client that fails, disconnects or misses the deadline becomes a ``Failure``.
        ``quorum``: a semi-asynchronous round (``Quorum``); a fleet that cannot run one raises
        ``ConfigError`` naming ``min_quorum``.
        """

    @abstractmethod
    def evaluate_round(
        self,
        *,
        server_round: int,
        global_state: ModelState,
        assignments: Sequence[tuple[ClientInfo, EvaluateIns]],
        timeout: timedelta,
    ) -> RoundOutcome[EvaluateRes]:
        """Asks each assigned client to evaluate ``global_state`` on its own data.

        A client that cannot evaluate, fails or misses the deadline becomes a ``Failure``.
        """

    def message_round(
        self,
        *,
        server_round: int,
        phase: str,
        assignments: Sequence[tuple[ClientInfo, MessageIns]],
        timeout: timedelta,
    ) -> RoundOutcome[MessageRes]:
        """Runs message phase ``phase``: each assigned client sends its messages; once all
        sent (or failed, or ``timeout`` passed) each one that sent receives the messages
        addressed to it by the others that sent. Returns what each client sent.

        A message to a recipient that is not a peer of the phase, or larger than the
        limits (``fedgrid.constants.MAX_PHASE_MESSAGE_BYTES``, ``MAX_OUTBOX_BYTES``),
        fails its sender, and nothing of it is relayed.
        """
        raise NotImplementedError(f"{type(self).__name__} does not run message phases")

    def committed(self, server_round: int) -> None:
        """Called once ``server_round`` is durably committed (its inputs may be dropped)."""

    def interrupt(self) -> None:
        """Makes blocking calls (``wait_for_clients``, ``fit_round``) return promptly."""

    def state_dict(self) -> dict[str, Any]:
        """What a restarted coordinator needs to reach the same clients (checkpointed)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores ``state_dict``."""

    def finish(self, *, timeout: timedelta) -> None:
        """Tells clients the run is over (waits at most ``timeout`` for them to hear it)."""

    def close(self) -> None:
        """Releases resources (servers, threads)."""
