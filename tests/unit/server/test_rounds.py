"""Message-phase rules (``check_outbox``, ``relay``) and handing an open task to a rejoining session."""

from __future__ import annotations

import pytest

from fedgrid.errors import InvalidUpdateError, PayloadTooLargeError
from fedgrid.fleet.protocol import check_outbox, relay
from fedgrid.server.rounds import RoundTask
from fedgrid.types import TO_ALL, TO_SERVER, ClientInfo, MessageIns

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


def _task(kind: str = "fit") -> RoundTask:
    from fedgrid.types import FitIns

    infos = [ClientInfo(client_id=f"old{i}", name=f"site-{i}") for i in range(3)]
    return RoundTask(
        server_round=2,
        task_id="run-r2-fit",
        kind=kind,
        assignments={info.client_id: FitIns(round=2, config={"seed": i}) for i, info in enumerate(infos)},
        clients={info.client_id: info for info in infos},
        deadline=0.0,
    )


def test_a_rejoining_session_takes_its_open_task_over_in_place():
    from fedgrid.types import Failure

    rnd = _task()
    rnd.failures["old1"] = Failure(rnd.clients["old1"], "client went silent (no heartbeat)")
    rnd.departed.add("old1")
    new = ClientInfo(client_id="new1", name="site-1")
    assert rnd.hand_over(new) == "old1"
    assert list(rnd.assignments) == ["old0", "new1", "old2"]  # its place in the order kept
    assert rnd.assignments["new1"].config == {"seed": 1} and rnd.clients["new1"] is new
    assert "old1" not in rnd.failures and rnd.is_pending("new1") and rnd.pending_count() == 3
    assert rnd.hand_over(ClientInfo(client_id="new0", name="site-0")) == "old0"  # pending, alive: replaced
    assert rnd.hand_over(ClientInfo(client_id="x", name="unknown")) is None


def test_a_handed_over_task_keeps_its_uplink_codec():
    from fedgrid.compression.spec import CodecSpec

    rnd = _task()
    rnd.codecs.update(old0=CodecSpec.parse("int8"), old1=CodecSpec.parse("topk"))
    assert rnd.hand_over(ClientInfo(client_id="new1", name="site-1")) == "old1"
    assert rnd.uplink_codec("new1").text == "topk" and "old1" not in rnd.codecs
    assert rnd.uplink_codec("old0").text == "int8" and rnd.uplink_codec("old2") == CodecSpec.NONE


def test_a_task_that_landed_failed_by_report_or_closed_is_not_handed_over():
    from fedgrid.types import Failure, FitRes

    rnd = _task()
    rnd.results["old0"] = FitRes(rnd.clients["old0"], {}, 1)
    rnd.failures["old1"] = Failure(rnd.clients["old1"], "client reported: ValueError")  # not a departure
    assert rnd.hand_over(ClientInfo(client_id="n0", name="site-0")) is None
    assert rnd.hand_over(ClientInfo(client_id="n1", name="site-1")) is None
    rnd.closed = True
    assert rnd.hand_over(ClientInfo(client_id="n2", name="site-2")) is None
    assert _task("keys").hand_over(ClientInfo(client_id="n2", name="site-2")) is None  # a message phase
