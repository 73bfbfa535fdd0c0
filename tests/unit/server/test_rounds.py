"""Message-phase rules: what a client may send (``check_outbox``) and who receives what (``relay``)."""

from __future__ import annotations

import pytest

from fedgrid.errors import InvalidUpdateError, PayloadTooLargeError
from fedgrid.server.rounds import check_outbox, relay
from fedgrid.types import TO_ALL, TO_SERVER, MessageIns

INS = MessageIns(round=1, phase="keys", client_id="b", peers=("a", "b", "c"))


def test_outbox_is_returned_in_peer_order_with_the_server_first():
    out = check_outbox(INS, {"c": b"3", TO_SERVER: b"s", "a": b"1"})
    assert list(out.items()) == [(TO_SERVER, b"s"), ("a", b"1"), ("c", b"3")]


@pytest.mark.parametrize(
    "messages, error, words",
    [
        ({"z": b"x"}, InvalidUpdateError, "recipient 'z' is not a peer"),
        ({"b": b"x"}, InvalidUpdateError, "cannot address itself"),
        ({TO_ALL: b"x", "a": b"y"}, InvalidUpdateError, "excludes messages to named peers"),
        ({"a": "text"}, InvalidUpdateError, "is str, not bytes"),
        ({"a": b"x" * 11}, PayloadTooLargeError, "11 bytes, at most 10"),
        ({"a": b"x" * 8, "c": b"y" * 8}, PayloadTooLargeError, "16 bytes of messages, at most 15"),
    ],
)
def test_bad_outboxes_are_refused_naming_the_problem(messages, error, words):
    with pytest.raises(error, match=words):
        check_outbox(INS, messages, max_message=10, max_total=15)


def test_relay_delivers_direct_and_broadcast_messages_to_senders_only():
    sent = {
        "a": {TO_ALL: b"A", TO_SERVER: b"to-server"},
        "b": {"a": b"b->a", "d": b"b->d"},  # d sent nothing (failed): it gets no inbox
        "c": {"b": b"c->b"},
    }
    inboxes = relay(["a", "b", "c", "d"], sent)
    assert {k: list(v.items()) for k, v in inboxes.items()} == {
        "a": [("b", b"b->a")],
        "b": [("a", b"A"), ("c", b"c->b")],
        "c": [("a", b"A")],
    }
