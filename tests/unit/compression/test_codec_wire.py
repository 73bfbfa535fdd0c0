"""Codecs inside the chunked model stream of ``fedgrid.proto.serde``: what the wire layer relies on."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from fedgrid.compression import get_codec
from fedgrid.compression.spec import CodecSpec
from fedgrid.errors import InvalidUpdateError, PayloadTooLargeError
from fedgrid.proto import serde

SPECS = [
    "fp16",
    "bf16",
    "int8",
    "qsgd:8",
    "topk:0.05",
    "randk:0.05",
    "powersgd:2",
    "sign",
    "none+zstd",
    "topk:0.01+zstd",
]


def _state() -> OrderedDict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return OrderedDict(
        [
            ("conv", torch.randn(8, 3, 3, 3, generator=gen)),
            ("fc", torch.randn(64, 50, generator=gen)),
            ("bias", torch.randn(64, generator=gen).to(torch.bfloat16)),
            ("steps", torch.tensor([12345], dtype=torch.int64)),
        ]
    )


@pytest.mark.parametrize("spec", SPECS)
def test_stream_round_trip_matches_the_codec(spec: str) -> None:
    state = _state()
    torch.manual_seed(3)  # stochastic codecs draw from the default generator here
    encoded = serde.EncodedModel(state, codec=CodecSpec.parse(spec))
    chunks = list(encoded.chunks(serde.StreamInfo(round=1), chunk_size=97))
    _, tensors = serde.decode_chunks(
        chunks, expected={k: serde.TensorSpec(v.dtype, tuple(v.shape)) for k, v in state.items()}
    )
    assert [c.tensor.codec for c in chunks if c.HasField("tensor")] == [spec] * len(state)
    codec = get_codec(spec)
    torch.manual_seed(3)  # the same draws again, tensor by tensor
    for name, t in state.items():
        want = codec.decode(codec.encode(t), dtype=t.dtype, shape=tuple(t.shape))
        assert torch.equal(tensors[name], want)
    assert torch.equal(tensors["steps"], state["steps"])
    raw = sum(v.numel() * v.element_size() for v in state.values())
    assert encoded.total_bytes < raw


def test_assembler_refuses_nbytes_over_the_codec_bound() -> None:
    state = OrderedDict(w=torch.randn(100, 100))
    chunks = list(serde.encode_model(state, serde.StreamInfo(), codec=CodecSpec.parse("topk:0.01")))
    limit = get_codec("topk:0.01").max_payload_bytes(dtype=torch.float32, shape=(100, 100))
    assert limit < 100 * 100 * 4 // 20
    chunks[0].tensor.nbytes = limit + 1
    chunks[0].header.total_bytes = limit + 1
    with pytest.raises(
        PayloadTooLargeError, match=rf"tensor 'w': declares {limit + 1} payload bytes, over the {limit}"
    ):
        serde.decode_chunks(chunks)


def test_stream_rejects_unknown_codecs_and_lying_payloads() -> None:
    state = OrderedDict(w=torch.randn(50, 40))
    chunks = list(
        serde.encode_model(state, serde.StreamInfo(), codec=CodecSpec.parse("int8"), chunk_size=1 << 20)
    )
    chunks[0].tensor.codec = "foo:1"
    with pytest.raises(InvalidUpdateError, match=r"tensor 'w': unknown codec 'foo'"):
        serde.decode_chunks(chunks)
    chunks = list(
        serde.encode_model(state, serde.StreamInfo(), codec=CodecSpec.parse("int8"), chunk_size=1 << 20)
    )
    data = bytearray(chunks[0].data)
    data[1:5] = (64).to_bytes(4, "little")
    chunks[0].data = bytes(data)
    chunks[0].tensor.checksum = serde.checksum(bytes(data))
    with pytest.raises(InvalidUpdateError, match=r"tensor 'w': int8 payload: header block size is 64"):
        serde.decode_chunks(chunks)
