"""Two clients with one identity (the same ``--partition``) against a real coordinator: the
replaced one stops with one line naming the identity, the other trains, nobody joins again
and again, and the coordinator's waiting line counts the conflict. A client restarted after
a crash takes over its session without any of that."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch

from fedgrid.cli.support import error_line
from fedgrid.client import IdentityConflict, start_client
from fedgrid.client.runtime import Connection
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto.tls import session_metadata

from harness import InProcessCoordinator, wait_until
from harness_clients import Named


def _joins(server: InProcessCoordinator) -> list[str]:
    joined: list[str] = []
    server.fleet.events.subscribe(
        lambda e: joined.append(e.fields["client"]) if e.event == "client_joined" else None
    )
    return joined


def test_the_replaced_client_of_a_duplicate_pair_stops_naming_its_identity(small_state, caplog):
    server = InProcessCoordinator(small_state)
    joins = _joins(server)
    try:
        # Long polls of 60 s, longer than the join below waits: the replaced client can only be
        # told by its poll ending at the replacement (the next call hears why), not by its expiry.
        first = start_client(Named("digits-0000/2"), server.address, poll_wait_s=60.0)
        wait_until(lambda: len(joins) == 1, timeout=20, what="the first client to join")
        second = start_client(Named("digits-0000/2"), server.address, poll_wait_s=60.0)
        with pytest.raises(IdentityConflict) as err:
            first.join(timeout=30)
        assert err.value.identity == "digits-0000/2"
        line = error_line(err.value)
        assert line.startswith("fedgrid: error: identity 'digits-0000/2' is taken: another process joined")
        assert "same --partition or the same certificate" in line and "\n" not in line
        assert server.fleet.membership.conflicts == {"digits-0000/2": 1}
        with caplog.at_level(logging.INFO, logger="fedgrid.server.remote_fleet"):
            with pytest.raises(TimeoutError):
                server.fleet.wait_for_clients(min_clients=2, timeout=timedelta(seconds=0))
        assert any(
            "waiting for 2 clients (1 joined, 1 identity conflict ('digits-0000/2'" in r.getMessage()
            for r in caplog.records
        )
        # The other one trains on, and nobody joined again meanwhile (no ping-pong).
        server.open_round()
        [result] = server.wait_round().results
        assert result.client.client_id == joins[1] and result.client.name == "digits-0000/2"
        assert torch.equal(result.state["layer.weight"], small_state["layer.weight"] + 1)
        server.fleet.finish(timeout=timedelta(seconds=20))
        assert second.join(timeout=20).rounds == 1
        assert len(joins) == 2 and server.fleet.membership.conflicts == {"digits-0000/2": 1}
    finally:
        server.stop()


def test_a_client_restarted_after_a_crash_takes_over_its_session(small_state):
    server = InProcessCoordinator(small_state)
    joins = _joins(server)
    try:
        crashed = Connection(server.address)
        crashed.join(Named("site-a"))
        # Its long poll is still open on the coordinator when the process dies: the poll ends
        # when the session is replaced, and is not taken for a second process.
        lingering = crashed.stub.PollTask.future(
            pb.PollRequest(client_id=crashed.client_id, wait_s=30),
            metadata=session_metadata(crashed.token),
            timeout=40,
        )
        wait_until(
            lambda: server.fleet.polls_held(crashed.client_id) == 1, timeout=10, what="the poll to wait"
        )
        restarted = start_client(Named("site-a"), server.address, poll_wait_s=5.0)
        wait_until(lambda: len(joins) == 2, timeout=20, what="the restarted client to join")
        reply = lingering.result(timeout=10)
        assert reply.WhichOneof("reply") != "task" and not reply.finished
        crashed.close()
        server.open_round()
        [result] = server.wait_round().results
        assert result.client.client_id == joins[1]
        assert server.fleet.membership.conflicts == {}
        server.fleet.finish(timeout=timedelta(seconds=20))
        assert restarted.join(timeout=20).rounds == 1
    finally:
        server.stop()
