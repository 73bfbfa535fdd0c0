"""Each tensor of an upload comes in its task's uplink codec (``TensorMeta.codec``), over a real
in-process gRPC coordinator: another codec is refused with INVALID_ARGUMENT naming the tensor,
the codec sent and the codec asked for, and changes nothing; what the encoder legitimately sends
otherwise (its canonical name for a spec written short, an integer tensor raw) is accepted."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator

import grpc
import pytest
import torch

from fedgrid.client.uplink import UplinkEncoder
from fedgrid.compression.spec import CodecSpec
from fedgrid.config_compression import task_uplink_codec
from fedgrid.fleet.codec_policy import CodecPolicy
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc
from fedgrid.proto import serde
from fedgrid.proto.tls import session_metadata

from harness import InProcessCoordinator


class _Probe:
    """A joined client with its open fit task, speaking raw gRPC."""

    def __init__(self, coordinator: InProcessCoordinator, stub, joined: pb.JoinReply, task: pb.Task) -> None:
        self.coordinator, self.stub, self.joined, self.task = coordinator, stub, joined, task
        self.config = serde.config_from_pb(task.config)

    def upload(self, items: list[tuple[str, torch.dtype, tuple[int, ...], str, bytes]], *, delta: bool):
        """Uploads ``(name, dtype, shape, TensorMeta.codec, payload)`` per tensor."""
        return self.send(serde.EncodedModel.from_payloads(items), delta=delta)

    def send(self, encoded: serde.EncodedModel, *, delta: bool):
        frames = list(encoded.chunks(self.info(delta), chunk_size=1 << 20))
        return self.stub.UploadUpdate(
            iter(frames), metadata=session_metadata(self.joined.session_token), timeout=10
        )

    def info(self, delta: bool) -> serde.StreamInfo:
        return serde.StreamInfo(
            run_id=self.joined.run_id,
            task_id=self.task.task_id,
            round=self.task.round,
            client_id=self.joined.client_id,
            num_examples=5,
            delta=delta,
        )

    def snapshot(self):
        """What a refused upload must leave as it was: the fleet's state and the open round."""
        fleet = self.coordinator.fleet
        rnd = fleet.current_round
        return (
            fleet.state_dict(),
            rnd.closed,
            sorted(rnd.results),
            sorted(rnd.failures),
            sorted(rnd.uploading),
            sorted(rnd.partials),
            rnd.bytes_up,
        )


@contextmanager
def _probe(small_state, codec: str) -> Iterator[_Probe]:
    """A coordinator whose uplink codec is ``codec`` (written as given) and a client that
    advertises its family, holding its round-1 fit task."""
    spec = CodecSpec.parse(codec)
    coordinator = InProcessCoordinator(small_state, codec_policy=CodecPolicy(default=spec))
    channel = grpc.insecure_channel(coordinator.address)
    try:
        stub = pb_grpc.CoordinatorStub(channel)
        capabilities = pb.Capabilities(codecs=[spec.family])
        joined = stub.Join(
            pb.JoinRequest(name="probe", num_examples=10, capabilities=capabilities), timeout=10
        )
        coordinator.open_round()
        reply = stub.PollTask(
            pb.PollRequest(client_id=joined.client_id, wait_s=5),
            metadata=session_metadata(joined.session_token),
            timeout=10,
        )
        assert reply.WhichOneof("reply") == "task"
        yield _Probe(coordinator, stub, joined, reply.task)
    finally:
        channel.close()
        coordinator.stop()


def _coded(state, codecs: dict[str, str]) -> list[tuple[str, torch.dtype, tuple[int, ...], str, bytes]]:
    """Each tensor of ``state`` encoded with the codec ``codecs`` names for it."""
    return [
        (name, t.dtype, tuple(t.shape), codecs[name], bytes(CodecSpec.read(codecs[name]).decoder.encode(t)))
        for name, t in state.items()
    ]


def _delta(small_state) -> "OrderedDict[str, torch.Tensor]":
    g = torch.Generator().manual_seed(1)
    return OrderedDict(
        (name, torch.randn(t.shape, generator=g) if t.is_floating_point() else t + 1)
        for name, t in small_state.items()
    )


def test_a_tensor_in_another_codec_than_its_tasks_is_refused_and_changes_nothing(small_state) -> None:
    with _probe(small_state, "int8") as probe:
        assert task_uplink_codec(probe.config).text == "int8"
        delta = _delta(small_state)
        before = probe.snapshot()
        mixed = _coded(delta, {"layer.weight": "int8", "layer.bias": "fp16", "steps": "none"})
        with pytest.raises(grpc.RpcError) as err:
            probe.upload(mixed, delta=True)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "tensor 'layer.bias': sent with codec 'fp16', the task asked for 'int8'"
        assert probe.snapshot() == before
        assert before[2:] == ([], [], [], [], 0)  # no result, failure, upload or bytes

        # The same update in the task's codec lands, and its tensors are int8's decoding.
        good = _coded(delta, {"layer.weight": "int8", "layer.bias": "int8", "steps": "none"})
        assert probe.upload(good, delta=True).accepted
        outcome = probe.coordinator.wait_round()
        assert [r.client.client_id for r in outcome.results] == [probe.joined.client_id]
        result = outcome.results[0]
        assert result.delta  # exact downlink, lossy uplink: the differences as sent
        int8 = CodecSpec.read("int8").decoder
        for name, dtype, shape, _, payload in good[:2]:
            assert torch.equal(result.state[name], int8.decode(payload, dtype=dtype, shape=shape))
        assert torch.equal(result.state["steps"], delta["steps"])


def test_an_upload_in_a_codec_to_a_task_without_one_is_refused(small_state) -> None:
    """The default task (no ``uplink_codec``: ``none``) takes raw values only: a float tensor in
    ``int8`` (even with delta=False, which ``none``'s delta check passes) is refused."""
    with _probe(small_state, "none") as probe:
        assert "uplink_codec" in probe.config and task_uplink_codec(probe.config) == CodecSpec.NONE
        before = probe.snapshot()
        state = OrderedDict((k, v + 1 if v.is_floating_point() else v) for k, v in small_state.items())
        with pytest.raises(grpc.RpcError) as err:
            probe.upload(
                _coded(state, {"layer.weight": "int8", "layer.bias": "none", "steps": "none"}), delta=False
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            err.value.details() == "tensor 'layer.weight': sent with codec 'int8', the task asked for 'none'"
        )
        assert probe.snapshot() == before
        assert probe.upload(_coded(state, dict.fromkeys(state, "none")), delta=False).accepted


def test_what_the_encoder_sends_is_accepted_under_a_spec_written_short(small_state) -> None:
    """A task written ``topk`` gets tensors named ``topk:0.1`` (the codec's own name) from the
    client's encoder: the same codec, accepted (an integer tensor raw as ``none`` is the first
    test's ``steps``)."""
    with _probe(small_state, "topk") as probe:
        codec = task_uplink_codec(probe.config)
        assert (codec.text, codec.name) == ("topk", "topk:0.1")
        trained = OrderedDict(
            (k, v + 0.5 if v.is_floating_point() else v + 1) for k, v in small_state.items()
        )
        encoded, delta = (
            UplinkEncoder(codec).begin(1, probe.config).encode(global_state=small_state, new_state=trained)
        )
        metas = [c.tensor for c in encoded.chunks(probe.info(delta)) if c.HasField("tensor")]
        assert delta and [(m.name, m.codec) for m in metas] == [(n, "topk:0.1") for n in small_state]
        assert probe.send(encoded, delta=delta).accepted
        outcome = probe.coordinator.wait_round()
        assert len(outcome.results) == 1 and outcome.results[0].delta
        assert int(outcome.results[0].state["steps"]) == 8  # an integer tensor travels whole
