"""Long polls: a client waits for its next task without holding a thread.

A poll is answered at once when the client has a pending task in the open round, when the
run is over (the client hears it finished) or when the coordinator is stopping; otherwise it
waits, woken only by what concerns this client (``server/wakeups.py``), until ``wait_s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fedgrid.errors import ResourceLimitError
from fedgrid.server.membership import ClientRecord, Membership
from fedgrid.server.rounds import RoundTask
from fedgrid.textsafe import escape
from fedgrid.types import FIT, EvaluateIns, FitIns, MessageIns

__all__ = ["PollResult", "Polls"]


@dataclass(frozen=True)
class PollResult:
    """What a long poll returns: a task, a hint to poll again, or the end of the run."""

    task_id: str = ""
    server_round: int = 0
    ins: FitIns | EvaluateIns | MessageIns | None = None
    kind: str = FIT  # FIT, EVALUATE or a message phase's name
    deadline_s: float = 0.0
    retry_after_s: float = 0.0
    finished: bool = False


class Polls:
    """The long-poll handler of a fleet.

    Args:
        membership: authenticates the client (its lock and wake-ups are the fleet's).
        current: the fleet's open round, or ``None``.
        finished: whether the run is over.
        interrupted: whether the coordinator is stopping.
        max_polls: long polls one client may hold at once.
    """

    def __init__(
        self,
        membership: Membership,
        current: Callable[[], RoundTask | None],
        *,
        finished: Callable[[], bool],
        interrupted: Callable[[], bool],
        max_polls: Callable[[], int],
    ) -> None:
        self.membership = membership
        self.lock, self.wake = membership.lock, membership.wake
        self._current = current
        self._finished = finished
        self._interrupted = interrupted
        self._max_polls = max_polls

    def now(self, record: ClientRecord) -> PollResult | None:
        """The poll's answer if there is one now (lock held)."""
        if self._finished():
            record.heard_finished = True
            self.wake.notify("finish")
            return PollResult(finished=True)
        if self._interrupted():  # stopping: answer now, before the server cancels the call
            return PollResult(retry_after_s=1.0)
        if self.membership.records.get(record.info.client_id) is not record:
            # Replaced or gone while it waited: its next call hears why (server/membership.py).
            return PollResult(retry_after_s=0.0)
        rnd = self._current()
        client_id = record.info.client_id
        if rnd is not None and not rnd.closed and rnd.is_pending(client_id):
            return PollResult(
                task_id=rnd.task_id,
                kind=rnd.kind,
                server_round=rnd.server_round,
                ins=rnd.assignments[client_id],
                deadline_s=max(0.0, rnd.deadline - self.membership.clock.now()),
            )
        return None

    async def wait(self, client_id: str, token: str, wait_s: float) -> PollResult:
        """Long poll: waits up to ``wait_s`` for a task for this client, woken only by what
        concerns it (its task, the end of the run, a stop); the wait holds no thread.

        Raises:
            AuthenticationError: unknown session.
            ResourceLimitError: the client already holds ``max_polls_per_client`` polls.
        """
        record = self.membership.authenticate(client_id, token)
        clock = self.membership.clock
        deadline = clock.now() + max(0.0, min(wait_s, 60.0))
        answer: list[PollResult] = []

        def ready() -> bool:
            result = self.now(record)
            if result is not None:
                answer.append(result)
            return result is not None

        with self.lock:
            if record.polls >= self._max_polls():
                raise ResourceLimitError(
                    f"client {escape(client_id)} already holds {record.polls} long polls (limit {self._max_polls()})"
                )
            record.polls += 1
        try:
            while True:
                await self.wake.wait_until_async(("poll", client_id), deadline, ready)
                if answer:
                    return answer[0]
                with self.lock:
                    record.last_seen = clock.now()
                if clock.now() >= deadline:
                    return PollResult(retry_after_s=0.0)
        finally:
            with self.lock:
                record.polls -= 1

    def held(self, client_id: str) -> int:
        """Long polls ``client_id`` holds now (0 for an unknown client)."""
        with self.lock:
            record = self.membership.records.get(client_id)
            return 0 if record is None else record.polls
