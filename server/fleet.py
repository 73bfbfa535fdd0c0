"""The ``Fleet`` seam: how the round engine reaches clients.

``RemoteFleet`` (``server/remote_fleet.py``) reaches real clients over the network; the
simulation fleets run them in process. The engine, strategies and codecs never know which.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Generic, Mapping, Sequence, TypeVar

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

__all__ = ["Fleet", "RoundOutcome"]


R = TypeVar("R", FitRes, EvaluateRes, MessageRes)


@dataclass(frozen=True)
class RoundOutcome(Generic[R]):
    """What came back from a round: results, failures (as data), clients cancelled because
    the round reached its target first (over-selection), the bytes moved, and why the
    round closed (``closed_by``: ``all``, ``target``, ``deadline`` or ``stopping``, see
    ``fedgrid.events``)."""

    results: list[R]
    failures: list[Failure]
    cancelled: list[ClientInfo] = field(default_factory=list)
    bytes_up: int = 0
    bytes_down: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    closed_by: str = "all"


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
    ) -> RoundOutcome[FitRes]:
        """Sends ``global_state`` and each client's task, returns by ``timeout`` at the latest,
        or as soon as ``target`` results have arrived (default: all assigned).

        A client that fails, disconnects or misses the deadline becomes a ``Failure``.
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
