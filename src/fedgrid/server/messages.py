"""Message phases on the coordinator: a client's messages checked and kept (``send``), the
relay once the phase closed (``relay``), and each client's inbox, long-polled and paged
(``receive_async``), until the round is committed (``clear``).

It shares the fleet's state lock and wake-ups (key ``("inbox", client_id)``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Mapping

from fedgrid.constants import MAX_INBOX_REPLY_BYTES
from fedgrid.errors import DuplicateUpdateError, InvalidUpdateError, StaleTaskError
from fedgrid.events import EventLog
from fedgrid.fleet.protocol import check_outbox, relay
from fedgrid.server.membership import Membership
from fedgrid.server.rounds import RoundTask
from fedgrid.textsafe import escape
from fedgrid.types import MessageIns, MessageRes

__all__ = ["InboxPage", "Mailbox"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InboxPage:
    """What ``receive_messages`` returns: once the phase closed (``ready``), the messages
    relayed to the client from ``start`` on, by sender, and how many there are in all."""

    ready: bool
    messages: list[tuple[str, bytes]]
    total: int = 0
    retry_after_s: float = 0.0


class Mailbox:
    """The message-phase handlers of a fleet.

    Args:
        membership: authenticates the sender (its lock and wake-ups are the fleet's).
        events: where accepted messages are reported.
        open_task: the fleet's check that a client has the open task ``task_id`` (lock held).
        current: the fleet's open task, or ``None``.
        interrupted: whether the fleet is stopping.
    """

    def __init__(
        self,
        membership: Membership,
        events: EventLog,
        open_task: Callable[[str, str], RoundTask],
        current: Callable[[], RoundTask | None],
        interrupted: Callable[[], bool],
    ) -> None:
        self.membership = membership
        self.lock = membership.lock
        self.wake = membership.wake
        self.events = events
        self._open_task = open_task
        self._current = current
        self._interrupted = interrupted
        #: Message phases of the round in progress, closed and relayed, by task id: their
        #: clients fetch their inboxes from here until the round is committed.
        self.relayed: dict[str, RoundTask] = {}

    def send(self, client_id: str, token: str, task_id: str, messages: Mapping[str, bytes]) -> int:
        """A client's messages of an open message phase (recipient -> payload, see
        ``protocol.check_outbox``); returns the payload bytes accepted.

        Raises:
            AuthenticationError, StaleTaskError: unknown session, or no open message task ``task_id``.
            DuplicateUpdateError: the client already sent its messages for this phase.
            InvalidUpdateError, PayloadTooLargeError: a bad recipient or sizes (nothing kept).
        """
        record = self.membership.authenticate(client_id, token)
        with self.lock:
            current = self._current()
            if current is not None and current.task_id == task_id and client_id in current.results:
                raise DuplicateUpdateError(
                    f"messages of phase {current.kind!r} from client {escape(client_id)} already accepted"
                )
            if record.benched_task == task_id:
                record.benched_task = ""
            rnd = self._open_task(client_id, task_id)
            if client_id in rnd.failures:
                raise StaleTaskError(
                    f"round {rnd.server_round}: this task already failed ({rnd.failures[client_id].reason})"
                )
            if not rnd.is_message:
                raise StaleTaskError(
                    f"task {escape(task_id)} is a {rnd.kind} task: it takes an upload, not messages"
                )
            ins = rnd.assignments[client_id]
            assert isinstance(ins, MessageIns)
            checked = check_outbox(ins, messages)
            rnd.results[client_id] = MessageRes(record.info, checked)
            size = sum(len(p) for p in checked.values())
            rnd.bytes_up += size
            self.wake.notify("round")
            accepted, expected = len(rnd.results), len(rnd.assignments)
        log.info(
            "round %d, phase %s: messages from %s (%d of %d)",
            rnd.server_round,
            rnd.kind,
            escape(record.info.name or client_id),
            accepted,
            expected,
        )
        self.events.emit(
            "messages_accepted",
            round=rnd.server_round,
            phase=rnd.kind,
            client=client_id,
            accepted=accepted,
            expected=expected,
        )
        return size

    def _inbox_now(self, client_id: str, task_id: str, start: int) -> InboxPage | None:
        """The client's inbox page once its phase was relayed (lock held)."""
        rnd = self.relayed.get(task_id)
        if rnd is None:
            current = self._current()
            if (
                current is None
                or current.task_id != task_id
                or not current.is_message
                or client_id not in current.assignments
            ):
                raise StaleTaskError(
                    f"task {escape(task_id)} is not a message phase of this round for client {escape(client_id)}"
                )
            if client_id in current.failures:
                raise StaleTaskError(
                    f"client {escape(client_id)} failed phase {current.kind!r}: {current.failures[client_id].reason}"
                )
            return None  # still open
        assert rnd.inboxes is not None
        inbox = rnd.inboxes.get(client_id)
        if inbox is None:
            failure = rnd.failures.get(client_id)
            raise StaleTaskError(
                f"client {escape(client_id)} has no inbox in phase {rnd.kind!r}"
                + (f": {failure.reason}" if failure else "")
            )
        items = list(inbox.items())
        if start > len(items):
            raise InvalidUpdateError(f"inbox start {start} is past its {len(items)} messages")
        page: list[tuple[str, bytes]] = []
        size = 0
        for sender, payload in items[start:]:
            if page and size + len(payload) > MAX_INBOX_REPLY_BYTES:
                break
            page.append((sender, payload))
            size += len(payload)
        return InboxPage(True, page, len(items))

    async def receive_async(
        self, client_id: str, token: str, task_id: str, start: int, wait_s: float
    ) -> InboxPage:
        """Long poll for the messages relayed to the client in message phase ``task_id``,
        from message ``start`` on (a large inbox comes in pages); waits up to ``wait_s`` for
        the phase to close.

        Raises:
            AuthenticationError: unknown session.
            StaleTaskError: no such phase for this client, or the client failed it.
        """
        self.membership.authenticate(client_id, token)
        clock = self.membership.clock
        deadline = clock.now() + max(0.0, min(wait_s, 60.0))
        answer: list[InboxPage] = []

        def ready() -> bool:
            page = self._inbox_now(client_id, task_id, start)
            if page is not None:
                answer.append(page)
            return page is not None or self._interrupted()

        while True:
            await self.wake.wait_until_async(("inbox", client_id), deadline, ready)
            if answer:
                return answer[0]
            if clock.now() >= deadline or self._interrupted():
                with self.lock:
                    return self._inbox_now(client_id, task_id, start) or InboxPage(
                        False, [], retry_after_s=0.0
                    )

    def relay(self, rnd: RoundTask) -> None:
        """The phase ``rnd`` closed: computes every inbox and wakes the clients waiting for theirs."""
        with self.lock:
            sent = {cid: res.messages for cid, res in rnd.results.items() if isinstance(res, MessageRes)}
            rnd.inboxes = relay(list(rnd.assignments), sent)
            # What the phase relays, counted when relayed (clients fetch it after the phase closed).
            rnd.bytes_down = sum(len(p) for inbox in rnd.inboxes.values() for p in inbox.values())
            self.relayed[rnd.task_id] = rnd
            self.wake.notify(*(("inbox", cid) for cid in rnd.assignments))

    def clear(self, server_round: int) -> None:
        """Round ``server_round`` was committed: the inboxes of earlier rounds go. Its own stay
        until the next commit: a round commits as soon as its last phase is relayed, and a client
        whose long poll had not yet woken still fetches that phase's inbox."""
        with self.lock:
            self.relayed = {tid: rnd for tid, rnd in self.relayed.items() if rnd.server_round >= server_round}
