"""Departures: a client giving up its task (``ReportFailure``: its ``fit``, ``evaluate`` or
message handler raised) or its session (``Leave``: it is stopping, interrupted or crashing).

Either is answered at once instead of at the round's deadline: the task fails with the
client's reason, a client that leaves is removed from the membership (its open task failed
there), and the waiters the change concerns are woken. A reason is client text: capped in
length (``MAX_REASON_CHARS``), kept as sent and escaped wherever logged.
"""

from __future__ import annotations

import logging
from typing import Callable

from fedgrid.constants import MAX_REASON_CHARS
from fedgrid.errors import DuplicateUpdateError, InvalidUpdateError
from fedgrid.events import EventLog
from fedgrid.server.membership import Membership
from fedgrid.server.rounds import RoundTask
from fedgrid.textsafe import escape
from fedgrid.types import Failure

__all__ = ["Departures"]

log = logging.getLogger(__name__)


def _check_reason(text: str) -> str:
    """A failure or leave reason: length-capped only. Unlike names, a reason may hold any
    text (exception messages span lines); it is kept as sent and escaped wherever logged.

    Raises:
        InvalidUpdateError: over ``MAX_REASON_CHARS`` characters.
    """
    if len(text) > MAX_REASON_CHARS:
        raise InvalidUpdateError(f"reason: {len(text)} characters, at most {MAX_REASON_CHARS}")
    return text


class Departures:
    """The failure-report and leave handlers of a fleet.

    Args:
        membership: authenticates the client and removes one that leaves (its lock and
            wake-ups are the fleet's).
        events: where reported failures and leaves go.
        open_task: the fleet's check that a client has the open task ``task_id`` (lock held).
    """

    def __init__(
        self, membership: Membership, events: EventLog, open_task: Callable[[str, str], RoundTask]
    ) -> None:
        self.membership = membership
        self.events = events
        self.lock, self.wake = membership.lock, membership.wake
        self._open_task = open_task

    def report_failure(self, client_id: str, token: str, task_id: str, reason: str) -> None:
        """The client's task ``task_id`` fails at once with ``reason``.

        Raises:
            AuthenticationError, StaleTaskError: unknown session, or no open task ``task_id``.
            DuplicateUpdateError: its result for the task was already accepted.
            InvalidUpdateError: an oversized reason (nothing recorded).
        """
        reason = _check_reason(reason)
        record = self.membership.authenticate(client_id, token)
        with self.lock:
            if record.benched_task == task_id:  # it finished the task it was benched for
                record.benched_task = ""
            rnd = self._open_task(client_id, task_id)
            if rnd.landed(client_id):
                raise DuplicateUpdateError(
                    f"result for round {rnd.server_round} from client {escape(client_id)} already accepted"
                )
            rnd.failures.setdefault(client_id, Failure(record.info, f"client reported: {reason}"))
            if client_id in rnd.carried:  # a late task failed: no result will come, the client is free
                rnd.carried.discard(client_id)
                self.wake.notify("membership")
            self.wake.notify("round")
        log.warning(
            "round %d: client %s reported a failure: %s",
            rnd.server_round,
            escape(record.info.name or client_id),
            escape(reason),
        )
        self.events.emit("failure_reported", round=rnd.server_round, client=client_id, reason=reason)

    def leave(self, client_id: str, token: str, reason: str) -> None:
        """The client is going: removed at once, its open task failed.

        Raises:
            AuthenticationError: unknown session.
            InvalidUpdateError: an oversized reason (nothing changed).
        """
        reason = _check_reason(reason)
        record = self.membership.authenticate(client_id, token)
        with self.lock:
            if client_id in self.membership.records:
                self.membership.remove(client_id, f"client left: {reason}")
            self.wake.notify("membership", ("poll", client_id), ("inbox", client_id))
        log.info("client %s left: %s", escape(record.info.name or client_id), escape(reason))
        self.events.emit("client_left", client=client_id, reason=reason)
