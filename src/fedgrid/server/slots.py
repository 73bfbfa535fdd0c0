"""Transfer slots: how many model downloads and uploads are in flight, in all and per peer.

A transfer holds the coordinator's memory, a thread now and then, and its share of the
link, so the servicer (``server/service.py``) bounds them three ways, and refuses a
transfer past any bound with ``ResourceLimitError`` (RESOURCE_EXHAUSTED, which clients
retry with backoff):

- per client (``MAX_TRANSFERS_PER_CLIENT``): keyed by the certificate's identity under mutual
  TLS, else by the session; counted from the moment the call's session is checked;
- per connection (``MAX_TRANSFERS_PER_CONNECTION``): keyed by the peer's address and port,
  so a process multiplexing many sessions on one connection holds only its share;
- in all (``MAX_TRANSFERS``): a global slot, taken only once the session is checked (and
  for an upload, once its header has arrived): a call without a valid session never
  holds one.

Nothing here blocks or locks: the servicer changes the counts on its event loop only.
"""

from __future__ import annotations

from types import TracebackType

from fedgrid.constants import MAX_TRANSFERS, MAX_TRANSFERS_PER_CLIENT, MAX_TRANSFERS_PER_CONNECTION
from fedgrid.errors import ResourceLimitError
from fedgrid.textsafe import escape

__all__ = ["TransferSlots", "Ticket"]


class TransferSlots:
    """The transfers in flight (event loop only).

    Args:
        total: transfers in flight on the coordinator at once.
        per_client: transfers one client (identity, or session without TLS) may hold.
        per_connection: transfers one connection may hold.

    Raises:
        ValueError: a bound under 1 (named).
    """

    def __init__(
        self,
        total: int = MAX_TRANSFERS,
        *,
        per_client: int = MAX_TRANSFERS_PER_CLIENT,
        per_connection: int = MAX_TRANSFERS_PER_CONNECTION,
    ) -> None:
        for name, value in (("total", total), ("per_client", per_client), ("per_connection", per_connection)):
            if value < 1:
                raise ValueError(f"transfer slots: {name} must be at least 1, got {value}")
        self.total, self.per_client, self.per_connection = total, per_client, per_connection
        self.in_flight = 0  # global slots held
        self.by_client: dict[str, int] = {}
        self.by_connection: dict[str, int] = {}

    def admit(self, client: str, connection: str) -> "Ticket":
        """A ticket of ``client`` on ``connection``, counted against both of their bounds
        (not yet the global one: ``Ticket.take``). Release it when the call ends.

        Raises:
            ResourceLimitError: the client or the connection holds its share already.
        """
        held = self.by_client.get(client, 0)
        if held >= self.per_client:
            raise ResourceLimitError(
                f"client {escape(client)} already has {held} transfers in flight "
                f"(limit {self.per_client} per client); retry when one ends"
            )
        on_connection = self.by_connection.get(connection, 0)
        if on_connection >= self.per_connection:
            raise ResourceLimitError(
                f"connection {escape(connection)} already has {on_connection} transfers in flight "
                f"(limit {self.per_connection} per connection); retry later"
            )
        self.by_client[client] = held + 1
        self.by_connection[connection] = on_connection + 1
        return Ticket(self, client, connection)

    def _release(self, ticket: "Ticket") -> None:
        for counts, key in ((self.by_client, ticket.client), (self.by_connection, ticket.connection)):
            left = counts[key] - 1
            if left:
                counts[key] = left
            else:
                del counts[key]  # no entry per peer once it holds nothing
        if ticket.holds_slot:
            self.in_flight -= 1


class Ticket:
    """One transfer's place in the counts; a context manager that releases it on exit."""

    def __init__(self, slots: TransferSlots, client: str, connection: str) -> None:
        self.slots, self.client, self.connection = slots, client, connection
        self.holds_slot = False
        self._released = False

    def take(self) -> None:
        """Takes a global slot (once).

        Raises:
            ResourceLimitError: ``total`` transfers are in flight.
        """
        slots = self.slots
        if self.holds_slot:
            return
        if slots.in_flight >= slots.total:
            raise ResourceLimitError(
                f"coordinator busy: {slots.in_flight} transfers in flight (limit {slots.total}); retry later"
            )
        slots.in_flight += 1
        self.holds_slot = True

    def release(self) -> None:
        """Gives back what the ticket holds (idempotent)."""
        if not self._released:
            self._released = True
            self.slots._release(self)

    def __enter__(self) -> "Ticket":
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
