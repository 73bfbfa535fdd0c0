"""Every malformed request gets a specific status and a message, and changes no state."""

from __future__ import annotations

import math
from collections import OrderedDict

import grpc
import pytest
import torch

from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc
from fedgrid.proto import serde
from fedgrid.proto.tls import session_metadata

#: The run id each probe session got at Join, by client id (an upload must name its run).
RUN_IDS: dict[str, str] = {}


def _join(stub, name, num_examples):
    joined = stub.Join(pb.JoinRequest(name=name, num_examples=num_examples), timeout=10)
    RUN_IDS[joined.client_id] = joined.run_id
    return joined


@pytest.fixture
def session(coordinator):
    """A joined client with an open task: (stub, client_id, token, task)."""
    channel = grpc.insecure_channel(coordinator.address)
    stub = pb_grpc.CoordinatorStub(channel)
    joined = _join(stub, "probe", 10)
    coordinator.open_round()
    reply = stub.PollTask(
        pb.PollRequest(client_id=joined.client_id, wait_s=5),
        metadata=session_metadata(joined.session_token),
        timeout=10,
    )
    assert reply.WhichOneof("reply") == "task"
    coordinator.snap = _snapshot(coordinator)
    yield stub, joined.client_id, joined.session_token, reply.task
    channel.close()


class _Stream(list):
    """An upload's chunks, and the session token its call carries in metadata."""

    def __init__(self, chunks, token: str) -> None:
        super().__init__(chunks)
        self.token = token


def _upload(stub, chunks, token=None):
    """Uploads ``chunks`` in the session ``token`` (default: the stream's own)."""
    return stub.UploadUpdate(
        iter(list(chunks)), metadata=session_metadata(chunks.token if token is None else token), timeout=10
    )


def _chunks(state, cid, token, task, **overrides):
    fields = {"run_id": RUN_IDS.get(cid, ""), "num_examples": 5, **overrides}
    info = serde.StreamInfo(task_id=task.task_id, round=task.round, client_id=cid, **fields)
    return _Stream(serde.encode_model(state, info, chunk_size=16), token)


def _good(small_state):
    return OrderedDict((k, v + 1 if v.is_floating_point() else v) for k, v in small_state.items())


def _with(small_state, name, value):
    state = _good(small_state)
    state[name] = value
    return state


def _snapshot(coordinator):
    """Everything a bad request must not change: the membership (ids, tokens, infos), the open
    round (task, results, failures, bytes accepted), and the global model's bytes. (A stream
    cut by the transport, as gRPC does on an oversized message, may leave its verified
    chunks for a resume: a transfer buffer, not coordinator state.)"""
    fleet = coordinator.fleet
    rnd = fleet.current_round
    model = rnd.downlink.for_client(None)[0].payloads()
    return (
        fleet.state_dict(),
        rnd.task_id,
        rnd.server_round,
        rnd.closed,
        sorted(rnd.results),
        sorted(rnd.failures),
        sorted(rnd.uploading),
        rnd.bytes_up,
        model,
    )


def _assert_untouched(coordinator):
    assert _snapshot(coordinator) == coordinator.snap
    assert coordinator.fleet.current_round.results == {}


CASES = {
    "wrong shape": (lambda s: _with(s, "layer.bias", torch.zeros(5)), "tensor 'layer.bias': wrong shape"),
    "wrong dtype": (
        lambda s: _with(s, "layer.weight", torch.zeros(4, 3, dtype=torch.float64)),
        "tensor 'layer.weight': wrong dtype",
    ),
    "NaN": (
        lambda s: _with(s, "layer.weight", torch.full((4, 3), math.nan)),
        "tensor 'layer.weight': contains NaN",
    ),
    "Inf": (
        lambda s: _with(s, "layer.bias", torch.tensor([1.0, math.inf, 0.0, 0.0])),
        "tensor 'layer.bias': contains Inf",
    ),
    "missing tensor": (lambda s: OrderedDict(list(_good(s).items())[:2]), "tensor count"),
    "extra tensor": (lambda s: _with(s, "intruder", torch.zeros(2)), "tensor count"),
    "unknown name": (
        lambda s: OrderedDict(
            [("layer.weight", s["layer.weight"]), ("layer.bias", s["layer.bias"]), ("nope", s["steps"])]
        ),
        "tensor 'nope' is not part of the model",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_update_is_rejected_and_changes_nothing(coordinator, session, small_state, case):
    stub, cid, token, task = session
    make, message = CASES[case]
    with pytest.raises(grpc.RpcError) as err:
        _upload(stub, _chunks(make(small_state), cid, token, task))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    _assert_untouched(coordinator)
    # The same client can still deliver a good update, which is the only one counted.
    good = _good(small_state)
    assert _upload(stub, _chunks(good, cid, token, task)).accepted
    outcome = coordinator.wait_round()
    assert len(outcome.results) == 1 and outcome.failures == []
    for name, tensor in good.items():
        assert torch.equal(outcome.results[0].state[name], tensor)


@pytest.mark.parametrize(
    "field, value",
    [("compute_s", 1.7e308), ("compute_s", -2e300), ("utilization", -3.0), ("wall_s", math.inf)],
)
def test_a_time_split_out_of_bounds_is_refused_naming_the_field(
    coordinator, session, small_state, field, value
):
    stub, cid, token, task = session
    with pytest.raises(grpc.RpcError) as err:
        _upload(stub, _chunks(_good(small_state), cid, token, task, metrics={field: value}))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"metric '{field}' is" in err.value.details()
    _assert_untouched(coordinator)


def test_bad_checksum(coordinator, session, small_state):
    stub, cid, token, task = session
    chunks = _chunks(_good(small_state), cid, token, task)
    chunks[0].tensor.checksum ^= 1
    with pytest.raises(grpc.RpcError) as err:
        _upload(stub, chunks)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensor 'layer.weight': checksum mismatch" in err.value.details()
    _assert_untouched(coordinator)


def test_flipped_payload_byte_fails_checksum(coordinator, session, small_state):
    stub, cid, token, task = session
    chunks = _chunks(_good(small_state), cid, token, task)
    chunks[1].data = bytes([chunks[1].data[0] ^ 0xFF]) + chunks[1].data[1:]
    with pytest.raises(grpc.RpcError) as err:
        _upload(stub, chunks)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "checksum mismatch" in err.value.details()
    _assert_untouched(coordinator)


def test_truncated_and_oversized_tensor(coordinator, session, small_state):
    stub, cid, token, task = session
    chunks = _chunks(_good(small_state), cid, token, task)
    with pytest.raises(grpc.RpcError) as err:
        _upload(stub, chunks[:-1], token)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "truncated" in err.value.details()
    longer = chunks[:2] + [pb.Chunk(data=b"\0" * 16)] + chunks[2:]
    with pytest.raises(grpc.RpcError) as err:
        _upload(stub, longer, token)
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "larger than declared" in err.value.details()
    )
    _assert_untouched(coordinator)


def test_message_over_limit_is_refused(coordinator, session, small_state):
    stub, cid, token, task = session
    chunks = _chunks(_good(small_state), cid, token, task)
    chunks.insert(1, pb.Chunk(data=b"\0" * (5 << 20)))
    with pytest.raises(grpc.RpcError) as err:
        _upload(stub, chunks)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    _assert_untouched(coordinator)


@pytest.mark.parametrize("who", ["unknown client", "bad token"])
def test_unauthenticated_everywhere(coordinator, session, small_state, who):
    stub, cid, token, task = session
    bad_cid, bad_token = ("not-a-client", token) if who == "unknown client" else (cid, token + "x")
    calls = {
        "upload": lambda: _upload(stub, _chunks(_good(small_state), bad_cid, bad_token, task)),
        "poll": lambda: stub.PollTask(
            pb.PollRequest(client_id=bad_cid, wait_s=0), metadata=session_metadata(bad_token), timeout=10
        ),
        "download": lambda: list(
            stub.DownloadModel(
                pb.DownloadRequest(client_id=bad_cid, task_id=task.task_id),
                metadata=session_metadata(bad_token),
                timeout=10,
            )
        ),
        "heartbeat": lambda: stub.Heartbeat(
            pb.HeartbeatRequest(client_id=bad_cid), metadata=session_metadata(bad_token), timeout=10
        ),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert ("unknown client" if who == "unknown client" else "bad session token") in err.value.details()
    _assert_untouched(coordinator)


UNARY = {
    "Join": (pb.JoinRequest, False),
    "PollTask": (pb.PollRequest, False),
    "DownloadModel": (pb.DownloadRequest, True),
    "UploadStatus": (pb.UploadStatusRequest, False),
    "Heartbeat": (pb.HeartbeatRequest, False),
    "ReportFailure": (pb.ReportFailureRequest, False),
    "Leave": (pb.LeaveRequest, False),
    "SendMessages": (pb.SendMessagesRequest, False),
    "ReceiveMessages": (pb.ReceiveMessagesRequest, False),
}


@pytest.mark.parametrize("method", sorted(UNARY))
def test_junk_request_is_invalid_argument_with_a_plain_message(coordinator, session, method):
    """Bytes that are not protobuf: INVALID_ARGUMENT naming the message type (gRPC's own
    deserializer answered UNKNOWN with the Python exception class)."""
    stub, cid, token, task = session
    message, streams = UNARY[method]
    channel = grpc.insecure_channel(coordinator.address)
    call = (channel.unary_stream if streams else channel.unary_unary)(
        f"/fedgrid.v1.Coordinator/{method}", request_serializer=None, response_deserializer=None
    )
    with channel, pytest.raises(grpc.RpcError) as err:
        reply = call(b"\xff\xff\xff\x07junk", metadata=session_metadata(token), timeout=10)
        if streams:
            list(reply)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        f"malformed {message.DESCRIPTOR.full_name}: the request is not a valid protobuf message"
    )
    _assert_untouched(coordinator)


def test_duplicate_and_stale_uploads(coordinator, session, small_state):
    stub, cid, token, task = session
    good = _good(small_state)
    assert _upload(stub, _chunks(good, cid, token, task)).accepted
    with pytest.raises(grpc.RpcError) as err:
        _upload(stub, _chunks(_good(good), cid, token, task))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "already accepted" in err.value.details()
    outcome = coordinator.wait_round()
    assert len(outcome.results) == 1
    assert torch.equal(outcome.results[0].state["layer.bias"], good["layer.bias"])
    with pytest.raises(grpc.RpcError) as err:  # a retry after the round closed still learns it landed
        _upload(stub, _chunks(good, cid, token, task))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    coordinator.open_round(server_round=2)
    with pytest.raises(grpc.RpcError) as err:  # an update for a round that is over
        _upload(stub, _chunks(good, cid, token, task))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not open" in err.value.details()
    assert coordinator.fleet.current_round.results == {}


def test_client_without_task_is_refused(coordinator, session, small_state):
    stub, _, _, task = session
    other = _join(stub, "late", 3)  # joined after the round opened
    coordinator.snap = _snapshot(coordinator)
    with pytest.raises(grpc.RpcError) as err:
        _upload(stub, _chunks(_good(small_state), other.client_id, other.session_token, task))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "has no task" in err.value.details()
    _assert_untouched(coordinator)


def _tampered(chunks, index, **fields):
    """Rewrites tensor meta fields of chunk ``index`` (and its data), keeping the checksum valid."""
    chunk = chunks[index]
    data = fields.pop("data", chunk.data)
    chunk.data = data
    for key, value in fields.items():
        setattr(chunk.tensor, key, value)
    chunk.tensor.nbytes = len(data)
    chunk.tensor.checksum = serde.checksum(data)
    return chunks


def test_unknown_codec(coordinator, session, small_state):
    stub, cid, token, task = session
    chunks = _chunks(_good(small_state), cid, token, task)
    chunks[0].tensor.codec = "zip-it"
    with pytest.raises(grpc.RpcError) as err:
        _upload(stub, chunks)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensor 'layer.weight': unknown codec 'zip-it'" in err.value.details()
    _assert_untouched(coordinator)


@pytest.mark.parametrize("codec", ["fp16", "int8", "topk:0.5"])
def test_compressed_payload_that_lies_about_its_size(small_state, codec):
    from fedgrid.compression.spec import CodecSpec
    from fedgrid.fleet.codec_policy import CodecPolicy

    from harness import InProcessCoordinator

    spec = CodecSpec.parse(codec)
    coordinator = InProcessCoordinator(small_state, codec_policy=CodecPolicy(default=spec))
    channel = grpc.insecure_channel(coordinator.address)
    try:
        stub = pb_grpc.CoordinatorStub(channel)
        joined = stub.Join(
            pb.JoinRequest(name="probe", num_examples=10, capabilities=pb.Capabilities(codecs=[spec.family])),
            timeout=10,
        )
        cid, token = joined.client_id, joined.session_token
        coordinator.open_round()
        task = stub.PollTask(
            pb.PollRequest(client_id=cid, wait_s=5), metadata=session_metadata(token), timeout=10
        ).task
        assert serde.config_from_pb(task.config)["uplink_codec"] == codec
        coordinator.snap = _snapshot(coordinator)
        # The task's codec sends differences (delta=True); each tensor is one of them.
        info = serde.StreamInfo(
            run_id=joined.run_id,
            task_id=task.task_id,
            round=task.round,
            client_id=cid,
            num_examples=5,
            delta=True,
        )
        chunks = _Stream(
            serde.EncodedModel(_good(small_state), codec=spec).chunks(info, chunk_size=1 << 20), token
        )
        payload = chunks[0].data
        chunks[0].header.total_bytes -= 2
        _tampered(chunks, 0, data=payload[:-2])  # two bytes short of what its own header says
        with pytest.raises(grpc.RpcError) as err:
            _upload(stub, chunks)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"tensor 'layer.weight': {codec} payload" in err.value.details()
        _assert_untouched(coordinator)
        # A compressed update that tells the truth is accepted and decoded.
        good = _Stream(
            serde.EncodedModel(_good(small_state), codec=spec).chunks(info, chunk_size=1 << 20), token
        )
        assert _upload(stub, good).accepted
    finally:
        channel.close()
        coordinator.stop()


def test_header_must_come_first(coordinator, session, small_state):
    stub, cid, token, task = session
    chunks = _chunks(_good(small_state), cid, token, task)
    chunks[0].ClearField("header")
    with pytest.raises(grpc.RpcError) as err:
        _upload(stub, chunks)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "header" in err.value.details()
    _assert_untouched(coordinator)
