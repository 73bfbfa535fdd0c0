"""``TransferSlots``: each client's and each connection's share, and the global slots."""

from __future__ import annotations

import pytest

from fedgrid.errors import ResourceLimitError
from fedgrid.server.slots import TransferSlots


def test_a_client_holds_at_most_its_share():
    slots = TransferSlots(10, per_client=2, per_connection=10)
    a1, a2 = slots.admit("a", "ipv4:10.0.0.1:1"), slots.admit("a", "ipv4:10.0.0.1:2")
    with pytest.raises(
        ResourceLimitError, match=r"client 'a' already has 2 transfers in flight \(limit 2 per client\)"
    ):
        slots.admit("a", "ipv4:10.0.0.1:3")
    b = slots.admit("b", "ipv4:10.0.0.1:1")  # another client is not affected
    a1.release()
    a1.release()  # idempotent
    a3 = slots.admit("a", "ipv4:10.0.0.1:3")
    assert slots.by_client == {"a": 2, "b": 1}
    for ticket in (a2, a3, b):
        ticket.release()
    assert slots.by_client == {} and slots.by_connection == {}  # nothing kept per peer


def test_a_connection_holds_at_most_its_share_whoever_sends():
    slots = TransferSlots(10, per_client=5, per_connection=3)
    tickets = [slots.admit(c, "ipv4:127.0.0.1:5000") for c in ("a", "b", "c")]
    with pytest.raises(
        ResourceLimitError, match=r"connection 'ipv4:127.0.0.1:5000' already has 3 .*limit 3 per connection"
    ):
        slots.admit("d", "ipv4:127.0.0.1:5000")
    slots.admit("d", "ipv4:127.0.0.1:5001").release()
    assert slots.by_client == {"a": 1, "b": 1, "c": 1}
    for t in tickets:
        t.release()


def test_global_slots_are_taken_only_by_take():
    slots = TransferSlots(2, per_client=4, per_connection=4)
    tickets = [slots.admit(c, c) for c in "abc"]
    assert slots.in_flight == 0  # admitted: counted per peer only
    tickets[0].take()
    tickets[0].take()  # once
    tickets[1].take()
    assert slots.in_flight == 2
    with pytest.raises(ResourceLimitError, match=r"coordinator busy: 2 transfers in flight \(limit 2\)"):
        tickets[2].take()
    with tickets[0]:
        pass  # leaving the block releases it
    assert slots.in_flight == 1
    tickets[2].take()
    for t in tickets:
        t.release()
    assert slots.in_flight == 0 and slots.by_client == {} and slots.by_connection == {}


@pytest.mark.parametrize("kwargs", [{"total": 0}, {"per_client": 0}, {"per_connection": -1}])
def test_bounds_under_one_are_refused(kwargs):
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))} must be at least 1"):
        TransferSlots(**{"total": 4, "per_client": 1, "per_connection": 1, **kwargs})
