"""One update path: the same bad update, sent to a deployed coordinator (``RemoteFleet`` over
in-process gRPC, port 0) and to the simulated fleet (``InProcessFleet``), is refused by the
same check with the same message (``fleet/protocol.py``); the client's round fails, the
other client's update still lands, and the model aggregated from the round is the good
update alone, bit for bit, on both."""

from __future__ import annotations

import math
from collections import OrderedDict
from datetime import timedelta

import grpc
import pytest
import torch

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.client.api import Client, FitOutput
from fedgrid.client.uplink import UplinkEncoder
from fedgrid.compression.spec import CodecSpec
from fedgrid.constants import MAX_NUM_EXAMPLES
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc
from fedgrid.proto import serde
from fedgrid.proto.tls import session_metadata
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.types import FitIns

pytestmark = pytest.mark.timeout(120)

JOINED = 10  # examples each client reports at Join


def _trained(state):
    return OrderedDict((k, v + 1 if v.is_floating_point() else v) for k, v in state.items())


def _with(state, name, value):
    out = _trained(state)
    out[name] = value
    return out


#: case: (the bad client's state from the global one, its num_examples, whether it sends a
#: difference on a ``none`` run, what the refusal says).
CASES = {
    "zero examples": (_trained, 0, False, "num_examples must be at least 1"),
    "more than joined": (
        _trained,
        JOINED + 1,
        False,
        f"num_examples: the update claims {JOINED + 1}, the client reported {JOINED} at join",
    ),
    "huge examples": (
        _trained,
        MAX_NUM_EXAMPLES + 1,
        False,
        f"num_examples: {MAX_NUM_EXAMPLES + 1} claimed, over the maximum",
    ),
    "NaN": (
        lambda s: _with(s, "layer.weight", torch.full((4, 3), math.nan)),
        5,
        False,
        "tensor 'layer.weight': contains NaN",
    ),
    "wrong shape": (
        lambda s: _with(s, "layer.bias", torch.zeros(5)),
        5,
        False,
        "tensor 'layer.bias': wrong shape",
    ),
    "delta on none": (
        _trained,
        5,
        True,
        "delta: the upload says delta=True, the task's uplink codec 'none' sends whole values",
    ),
}


class Fixed(Client):
    """A simulated client whose ``fit`` returns what the test set."""

    def __init__(self, name: str, out: FitOutput) -> None:
        self.name, self.out = name, out

    @property
    def num_examples(self) -> int:
        return JOINED

    def fit(self, state, ins):
        return self.out


def _deployed(coordinator, small_state, case):
    """Both clients over gRPC: (the bad upload's status code and details, the round's outcome)."""
    make, num_examples, delta, _ = CASES[case]
    channel = grpc.insecure_channel(coordinator.address)
    stub = pb_grpc.CoordinatorStub(channel)
    joined = {
        name: stub.Join(pb.JoinRequest(name=name, num_examples=JOINED), timeout=10)
        for name in ("bad", "good")
    }
    coordinator.open_round(min_clients=2)
    tasks = {}
    for name, j in joined.items():
        reply = stub.PollTask(
            pb.PollRequest(client_id=j.client_id, wait_s=5),
            metadata=session_metadata(j.session_token),
            timeout=10,
        )
        tasks[name] = reply.task

    def upload(name, state, **fields):
        j, task = joined[name], tasks[name]
        info = serde.StreamInfo(
            task_id=task.task_id, round=task.round, client_id=j.client_id, run_id=j.run_id, **fields
        )
        chunks = serde.encode_model(state, info, chunk_size=64)
        return stub.UploadUpdate(iter(chunks), metadata=session_metadata(j.session_token), timeout=10)

    assert upload("good", _trained(small_state), num_examples=5).accepted
    with pytest.raises(grpc.RpcError) as refused:
        upload("bad", make(small_state), num_examples=num_examples, delta=delta)
    # A client that cannot deliver reports the error as its task's failure (client/runtime.py).
    bad = joined["bad"]
    stub.ReportFailure(
        pb.ReportFailureRequest(
            client_id=bad.client_id,
            task_id=tasks["bad"].task_id,
            reason=f"InvalidUpdateError: {refused.value.details()}",
        ),
        metadata=session_metadata(bad.session_token),
        timeout=10,
    )
    outcome = coordinator.wait_round()
    channel.close()
    return refused.value.code(), refused.value.details(), outcome


def _simulated(small_state, case):
    make, num_examples, delta, _ = CASES[case]
    fleet = InProcessFleet(
        [
            Fixed("bad", FitOutput(make(small_state), num_examples, {})),
            Fixed("good", FitOutput(_trained(small_state), 5, {})),
        ]
    )
    if delta:  # the bad client's uplink sends differences, whatever its task's codec says
        fleet.fast_lossless = False
        encoder = UplinkEncoder(CodecSpec.parse("int8"))
        real = fleet._uplink
        fleet._uplink = (  # type: ignore[method-assign]
            lambda cid, codec: encoder if cid == bad.client_id else real(cid, codec)
        )
    bad, good = fleet.wait_for_clients(min_clients=2, timeout=timedelta(seconds=1))
    assignments = [(bad, FitIns(round=1)), (good, FitIns(round=1))]
    return fleet.fit_round(
        server_round=1, global_state=small_state, assignments=assignments, timeout=timedelta(seconds=60)
    )


def _aggregate(small_state, results):
    strategy = FedAvg()
    strategy.initialize(initial_state=small_state)
    strategy.aggregate(server_round=1, results=results, failures=[])
    return strategy.global_state


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_update_fails_the_same_way_deployed_and_simulated(coordinator, small_state, case):
    message = CASES[case][3]
    code, details, deployed = _deployed(coordinator, small_state, case)
    simulated = _simulated(small_state, case)
    # The same check refused it, with the same message.
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details
    [sim_failure] = simulated.failures
    assert sim_failure.client.name == "bad" and sim_failure.reason == f"InvalidUpdateError: {details}"
    [grpc_failure] = deployed.failures
    assert grpc_failure.reason == f"client reported: {sim_failure.reason}"
    # The round went on: the good update landed on both, and only it made the model.
    expected = _trained(small_state)
    for outcome in (deployed, simulated):
        [result] = outcome.results
        assert result.client.name == "good" and result.num_examples == 5
        model = _aggregate(small_state, outcome.results)
        for name, tensor in expected.items():
            torch.testing.assert_close(model[name], tensor, rtol=0, atol=0)
