"""A client's progress inside its task travels on its heartbeats to the status page's client
row (issue 40, item 4); a heartbeat whose figures are out of range is refused naming the field,
and changes nothing (``server/progress.py``)."""

from __future__ import annotations

import math

import grpc
import pytest

from fedgrid.client.api import Client
from fedgrid.client.progress import ProgressReport
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc
from fedgrid.proto.tls import session_metadata
from fedgrid.server.monitor import CoordinatorMonitor


@pytest.fixture
def joined(coordinator):
    channel = grpc.insecure_channel(coordinator.address)
    stub = pb_grpc.CoordinatorStub(channel)
    reply = stub.Join(pb.JoinRequest(name="progressing", num_examples=10), timeout=10)
    monitor = CoordinatorMonitor(coordinator.fleet, rounds=3, history=lambda: [])
    yield stub, reply.client_id, reply.session_token, monitor
    channel.close()


def _beat(stub, client_id, token, **progress):
    request = pb.HeartbeatRequest(client_id=client_id)
    if progress:
        request.progress.CopyFrom(pb.TaskProgress(**progress))
    return stub.Heartbeat(request, metadata=session_metadata(token), timeout=10)


def _row(monitor):
    (row,) = monitor.status()["clients"]
    return row


GOOD = dict(round=2, steps_done=120, steps_total=500, examples_per_s=85.25, tokens_per_s=5456.0, eta_s=65.0)


def test_a_heartbeats_progress_shows_in_its_clients_row_until_one_without(joined):
    stub, cid, token, monitor = joined
    assert _row(monitor)["progress"] is None
    _beat(stub, cid, token, **GOOD)
    assert _row(monitor)["progress"] == GOOD
    _beat(stub, cid, token)  # the task's training ended
    assert _row(monitor)["progress"] is None


def test_the_clients_own_heartbeat_carries_its_board(coordinator, joined):
    from fedgrid.client.connection import Connection

    _, _, _, monitor = joined

    class Reporter(Client):
        name = "reporter"

        @property
        def num_examples(self) -> int:
            return 5

        def fit(self, state, ins):
            raise NotImplementedError

    conn = Connection(coordinator.address)
    try:
        conn.join(Reporter())
        report = ProgressReport(1, 7, 0, 12.5, 0.0, -1.0)  # a task bounded in time: no total, no eta
        conn.heartbeat_future(report).result(timeout=10)
        rows = {r["name"]: r for r in monitor.status()["clients"]}
        assert rows["reporter"]["progress"] == {
            "round": 1,
            "steps_done": 7,
            "steps_total": 0,
            "examples_per_s": 12.5,
            "tokens_per_s": 0.0,
            "eta_s": -1.0,
        }
    finally:
        conn.close()


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"examples_per_s": math.nan}, "progress.examples_per_s"),
        ({"examples_per_s": -1.0}, "progress.examples_per_s"),
        ({"tokens_per_s": math.inf}, "progress.tokens_per_s"),
        ({"tokens_per_s": 1.7e308}, "progress.tokens_per_s"),
        ({"eta_s": -2.0}, "progress.eta_s"),
        ({"eta_s": 1e9}, "progress.eta_s"),
        ({"steps_done": 501}, "progress.steps_done 501 is over its steps_total 500"),
        ({"steps_done": 2 * 10**12, "steps_total": 0}, "progress.steps_done"),
        ({"steps_total": 2 * 10**12}, "progress.steps_total"),
    ],
)
def test_out_of_range_figures_are_refused_naming_the_field_and_change_nothing(joined, bad, field):
    stub, cid, token, monitor = joined
    _beat(stub, cid, token, **GOOD)
    with pytest.raises(grpc.RpcError) as err:
        _beat(stub, cid, token, **{**GOOD, **bad})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    assert _row(monitor)["progress"] == GOOD
