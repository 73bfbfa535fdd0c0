"""Unit tests of ``fedgrid.proto.serde``: chunked model streams, their validation, small messages."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedgrid.errors import InvalidUpdateError, PayloadTooLargeError
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import serde
from fedgrid.types import ClientInfo

MiB = 1 << 20


# -- helpers -------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes (float8 and NaN payloads have no usable ``==``)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs included for floats); 0/1 for bool."""
    gen = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _roundtrip(state, *, chunk_size: int = 64, expected=None):
    chunks = list(serde.encode_model(state, serde.StreamInfo(), chunk_size=chunk_size))
    return serde.decode_chunks(chunks, expected=expected)[1]


def _stream(state, **kw) -> list[pb.Chunk]:
    chunk_size = kw.pop("chunk_size", 64)
    return list(serde.encode_model(state, serde.StreamInfo(**kw), chunk_size=chunk_size))


def _raises(chunks, match: str, *, expected=None, exc=InvalidUpdateError, **limits):
    with pytest.raises(exc, match=match):
        serde.decode_chunks(chunks, expected=expected, **limits)


def _state(**tensors: torch.Tensor) -> "OrderedDict[str, torch.Tensor]":
    return OrderedDict(tensors)


W = torch.arange(6, dtype=torch.float32).reshape(2, 3)  # 24 bytes
B = torch.tensor([0.5, -1.5], dtype=torch.float32)  # 8 bytes


# -- round trips ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(serde.DTYPE_TO_PB), ids=str)
def test_roundtrip_every_dtype_bit_exact(dtype):
    t = _random_tensor(dtype, (3, 7), seed=1)
    out = _roundtrip(_state(t=t), chunk_size=16)
    assert out["t"].dtype == dtype
    assert out["t"].shape == (3, 7)
    assert torch.equal(_bits(out["t"]), _bits(t))


@pytest.mark.parametrize("dtype", list(serde.DTYPE_TO_PB), ids=str)
def test_roundtrip_empty_and_scalar_every_dtype(dtype):
    empty = torch.empty((0, 5), dtype=dtype)
    scalar = _random_tensor(dtype, (), seed=2)
    out = _roundtrip(
        _state(empty=empty, scalar=scalar), expected=serde.TensorSpec.of({"empty": empty, "scalar": scalar})
    )
    assert out["empty"].dtype == dtype and out["empty"].shape == (0, 5)
    assert out["scalar"].dtype == dtype and out["scalar"].shape == ()
    assert torch.equal(_bits(out["scalar"]), _bits(scalar))


def test_dtype_tables_are_inverse_and_cover_the_proto_enum():
    assert len(serde.DTYPE_TO_PB) == 19
    assert {serde.PB_TO_DTYPE[v]: v for v in serde.PB_TO_DTYPE} == serde.DTYPE_TO_PB
    assert set(serde.PB_TO_DTYPE) == set(pb.DType.values()) - {pb.DTYPE_UNSPECIFIED}


def test_roundtrip_large_tensor_default_chunks():
    t = torch.randn(3_000_000, generator=torch.Generator().manual_seed(0))
    chunks = list(serde.encode_model({"big": t}, serde.StreamInfo()))
    assert len(chunks) == math.ceil(12_000_000 / serde.CHUNK_SIZE)
    _, out = serde.decode_chunks(chunks, expected=serde.TensorSpec.of({"big": t}))
    assert torch.equal(out["big"], t)


def test_roundtrip_non_contiguous_tensor():
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()
    out = _roundtrip({"t": t})
    assert out["t"].shape == (4, 3)
    assert torch.equal(out["t"], t)


def test_header_fields_roundtrip():
    info = serde.StreamInfo(
        run_id="run-1",
        task_id="task-9",
        round=7,
        client_id="c-3",
        num_examples=123,
        metrics={"loss": 0.25, "acc": 1.0},
    )
    got, tensors = serde.decode_chunks(serde.encode_model({"w": W}, info))
    assert got == info
    assert list(tensors) == ["w"]


def test_decode_returns_expected_order():
    state = _state(b=B, w=W)
    expected = serde.TensorSpec.of(_state(w=W, b=B))
    out = _roundtrip(state, expected=expected)
    assert list(out) == ["w", "b"]
    assert torch.equal(out["w"], W) and torch.equal(out["b"], B)


def test_model_without_tensors_is_one_header_message():
    chunks = _stream({}, run_id="r")
    assert len(chunks) == 1
    assert chunks[0].HasField("header") and not chunks[0].HasField("tensor") and chunks[0].data == b""
    info, tensors = serde.decode_chunks(chunks)
    assert info.run_id == "r" and len(tensors) == 0


def test_encoded_model_streams_same_bytes_twice():
    enc = serde.EncodedModel({"w": W, "b": B})
    assert len(enc) == 2 and enc.total_bytes == 32
    first = [c.SerializeToString() for c in enc.chunks(serde.StreamInfo(round=1), chunk_size=10)]
    second = [c.SerializeToString() for c in enc.chunks(serde.StreamInfo(round=1), chunk_size=10)]
    assert first == second


def test_lazy_encoded_model_hashes_each_tensor_as_its_first_frame_is_built(monkeypatch):
    """An upload hashes a tensor when its first frame is built, not the whole model up front,
    and puts the same bytes on the wire as an eager encoding (a download's)."""
    hashed: list[int] = []
    real = serde.checksum

    def counting(data):
        hashed.append(len(data))
        return real(data)

    monkeypatch.setattr("fedgrid.proto.encoding.checksum", counting)
    state = {"w": W, "b": B}
    eager = serde.EncodedModel(state)
    assert hashed == [24, 8]
    hashed.clear()
    lazy = serde.EncodedModel(state, lazy=True)
    assert hashed == [] and lazy.total_bytes == 32
    frames = lazy.frames(serde.StreamInfo(round=1), chunk_size=10)
    first = next(frames)
    assert hashed == [24]  # w's first frame: w only
    rest = list(frames)
    assert hashed == [24, 8]
    assert [first, *rest] == list(eager.frames(serde.StreamInfo(round=1), chunk_size=10))
    hashed.clear()
    assert [first, *rest] == list(lazy.frames(serde.StreamInfo(round=1), chunk_size=10))
    assert hashed == []  # hashed once, streamed again (a resumed upload)
    assert lazy.payloads() == eager.payloads()


def test_encode_rejects_unsendable_dtype_naming_tensor():
    with pytest.raises(
        InvalidUpdateError, match=r"tensor 'scale': dtype torch.float8_e8m0fnu cannot be sent"
    ):
        serde.EncodedModel({"scale": torch.zeros(2, dtype=torch.float8_e8m0fnu)})


@pytest.mark.parametrize("chunk_size", [0, -1])
def test_chunks_rejects_nonpositive_chunk_size(chunk_size):
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        list(serde.encode_model({"w": W}, serde.StreamInfo(), chunk_size=chunk_size))


# -- chunking ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "nbytes,messages",
    [(1, 1), (63, 1), (64, 1), (65, 2), (127, 2), (128, 2), (129, 3), (640, 10)],
)
def test_chunk_count_around_boundaries(nbytes, messages):
    t = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)
    chunks = _stream({"t": t}, chunk_size=64)
    assert len(chunks) == messages
    assert [len(c.data) for c in chunks] == [64] * (messages - 1) + [nbytes - 64 * (messages - 1)]
    assert chunks[0].HasField("header") and chunks[0].HasField("tensor")
    assert not any(c.HasField("header") or c.HasField("tensor") for c in chunks[1:])
    # data-only messages carry 2 bytes of field framing; the first also carries header and meta
    assert all(c.ByteSize() <= 64 + 2 for c in chunks[1:])
    assert chunks[0].ByteSize() <= 64 + 64
    assert torch.equal(serde.decode_chunks(chunks)[1]["t"], t)


@settings(max_examples=150, deadline=None, database=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=0, max_size=4), chunk_size=st.integers(1, 100))
def test_chunking_property(sizes, chunk_size):
    state = OrderedDict(
        (f"t{i}", torch.arange(n, dtype=torch.int64).to(torch.uint8)) for i, n in enumerate(sizes)
    )
    chunks = _stream(state, chunk_size=chunk_size)
    assert len(chunks) == max(1, sum(max(1, math.ceil(n / chunk_size)) for n in sizes))
    assert all(len(c.data) <= chunk_size for c in chunks)
    _, out = serde.decode_chunks(chunks, expected=serde.TensorSpec.of(state))
    assert list(out) == list(state)
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_chunk_count_several_tensors():
    state = _state(
        a=torch.zeros(63, dtype=torch.uint8),
        b=torch.zeros(64, dtype=torch.uint8),
        c=torch.zeros(65, dtype=torch.uint8),
        d=torch.zeros(128, dtype=torch.uint8),
        e=torch.zeros((0, 5), dtype=torch.uint8),
    )
    chunks = _stream(state, chunk_size=64)
    assert len(chunks) == 1 + 1 + 2 + 2 + 1
    assert [c.tensor.name for c in chunks if c.HasField("tensor")] == ["a", "b", "c", "d", "e"]
    assert sum(c.HasField("header") for c in chunks) == 1
    assert chunks[0].header.num_tensors == 5 and chunks[0].header.total_bytes == 63 + 64 + 65 + 128
    assert all(c.ByteSize() <= 64 + 64 for c in chunks)


def test_default_chunk_size_is_one_mib():
    assert serde.CHUNK_SIZE == MiB


def test_ten_mb_model_messages_stay_under_1_1_mib():
    state = _state(
        w1=torch.zeros(1_500_000, dtype=torch.float32),
        w2=torch.zeros(1_000_000, dtype=torch.float32),
        b=torch.zeros(1000, dtype=torch.float32),
    )  # 10,004,000 bytes
    chunks = list(serde.encode_model(state, serde.StreamInfo(run_id="r", task_id="t", round=3)))
    assert len(chunks) == math.ceil(6_000_000 / MiB) + math.ceil(4_000_000 / MiB) + 1
    sizes = [serde.wire_size(c) for c in chunks]
    assert max(sizes) <= int(1.1 * MiB)
    assert max(sizes) > MiB  # full chunks really are full
    assert sum(len(c.data) for c in chunks) == 10_004_000


def test_wire_size_is_bytesize_plus_grpc_framing():
    for c in _stream({"w": W, "b": B}, chunk_size=10):
        assert serde.wire_size(c) == c.ByteSize() + 5
        assert serde.wire_size(c) == len(c.SerializeToString()) + 5


def test_assembler_counts_wire_bytes():
    chunks = _stream({"w": W, "b": B}, chunk_size=10)
    asm = serde.ModelAssembler()
    for c in chunks:
        asm.feed(c)
    asm.finish()
    assert asm.wire_bytes == sum(c.ByteSize() + 5 for c in chunks)


def test_checksum_is_xxh3_of_payload():
    chunks = _stream({"w": W})
    assert chunks[0].tensor.checksum == serde.checksum(W.numpy().tobytes())
    assert serde.checksum(b"") != serde.checksum(b"\x00")


# -- assembler rejections --------------------------------------------------------------------
EXPECTED = serde.TensorSpec.of(_state(w=W, b=B))


def test_rejects_wrong_shape():
    chunks = _stream(_state(w=W.reshape(3, 2), b=B))
    _raises(chunks, r"tensor 'w': wrong shape \[3, 2\], expected \[2, 3\]", expected=EXPECTED)


def test_rejects_wrong_dtype():
    chunks = _stream(_state(w=W.double(), b=B))
    _raises(chunks, r"tensor 'w': wrong dtype torch.float64, expected torch.float32", expected=EXPECTED)


def test_rejects_missing_tensor():
    _raises(_stream(_state(w=W)), r"tensor count: header declares 1 tensors, expected 2", expected=EXPECTED)


def test_rejects_extra_tensor():
    chunks = _stream(_state(w=W, b=B, c=B.clone()))
    _raises(chunks, r"tensor count: header declares 3 tensors, expected 2", expected=EXPECTED)


def test_rejects_tensor_beyond_declared_count():
    chunks = _stream(_state(w=W, b=B))
    chunks[0].header.num_tensors = 1
    _raises(chunks, r"tensor count: 'b' is beyond the 1 tensors declared")


def test_rejects_unknown_tensor_name():
    chunks = _stream(_state(w=W, c=B))
    _raises(chunks, r"tensor 'c' is not part of the model", expected=EXPECTED)


@pytest.mark.parametrize("index", [0, 5, 23])
def test_rejects_bad_checksum(index):
    chunks = _stream(_state(w=W), chunk_size=10)  # data chunks: 10 + 10 + 4 bytes
    which, offset = divmod(index, 10)
    data = bytearray(chunks[which].data)
    data[offset] ^= 0x01
    chunks[which].data = bytes(data)
    _raises(chunks, r"tensor 'w': checksum mismatch")


def test_rejects_truncated_stream_last_data_chunk_dropped():
    chunks = _stream(_state(b=B, w=W), chunk_size=10)
    _raises(chunks[:-1], r"tensor 'w': truncated, received 20 of 24 bytes")


def test_rejects_truncated_stream_last_tensor_dropped():
    chunks = _stream(_state(w=W, b=B), chunk_size=64)
    assert len(chunks) == 2
    _raises(chunks[:-1], r"truncated stream: missing tensors \['b'\]", expected=EXPECTED)
    _raises(chunks[:-1], r"truncated stream: header declared 2 tensors, received 1")


def test_rejects_data_larger_than_declared():
    chunks = _stream(_state(w=W, b=B), chunk_size=64)
    chunks.append(pb.Chunk(data=b"\x00" * 4))
    with pytest.raises(PayloadTooLargeError, match=r"tensor 'b': larger than declared \(12 > 8 bytes\)"):
        serde.decode_chunks(chunks)


def test_rejects_nbytes_over_dtype_and_shape():
    chunks = _stream(_state(w=W))
    chunks[0].tensor.nbytes = 25
    chunks[0].header.total_bytes = 25
    with pytest.raises(PayloadTooLargeError, match=r"tensor 'w': declares 25 payload bytes, over the 24"):
        serde.decode_chunks(chunks)


def test_rejects_nbytes_under_dtype_and_shape():
    payload = W.numpy().tobytes()[:8]
    meta = pb.TensorMeta(
        name="w", dtype=pb.FLOAT32, shape=[2, 3], codec="none", nbytes=8, checksum=serde.checksum(payload)
    )
    chunk = pb.Chunk(header=pb.StreamHeader(num_tensors=1, total_bytes=8), tensor=meta, data=payload)
    _raises([chunk], r"tensor 'w': payload is 8 bytes, torch.float32 \[2, 3\] needs 24")


def test_rejects_tensor_over_max_tensor_bytes():
    with pytest.raises(PayloadTooLargeError, match=r"tensor 'w': declares 24 payload bytes, over the 16"):
        serde.decode_chunks(_stream({"w": W}), max_tensor_bytes=16)


def test_rejects_stream_over_max_total_bytes():
    with pytest.raises(PayloadTooLargeError, match=r"stream declares 32 payload bytes, over the limit of 31"):
        serde.decode_chunks(_stream({"w": W, "b": B}), max_total_bytes=31)


def test_rejects_tensor_past_declared_total():
    chunks = _stream(_state(w=W, b=B))
    chunks[0].header.total_bytes = 30
    with pytest.raises(
        PayloadTooLargeError, match=r"tensor 'b': payload runs past the stream's declared total"
    ):
        serde.decode_chunks(chunks)


def test_rejects_total_under_declared():
    chunks = _stream(_state(w=W, b=B))
    chunks[0].header.total_bytes = 40
    _raises(chunks, r"stream declared 40 payload bytes, received 32")


def test_rejects_unknown_codec():
    chunks = _stream(_state(w=W))
    chunks[0].tensor.codec = "zstd"
    _raises(chunks, r"tensor 'w': unknown codec 'zstd' \(known: none")


def test_rejects_unknown_dtype():
    chunks = _stream(_state(w=W))
    chunks[0].tensor.dtype = pb.DTYPE_UNSPECIFIED
    _raises(chunks, r"tensor 'w': unknown dtype 0")


def test_rejects_negative_dimension():
    chunks = _stream(_state(w=W))
    chunks[0].tensor.shape[:] = [-2, -3]
    _raises(chunks, r"tensor 'w': negative dimension in shape \[-2, -3\]")


def test_rejects_empty_tensor_name():
    chunks = _stream(_state(w=W))
    chunks[0].tensor.name = ""
    _raises(chunks, r"tensor with an empty name")


def test_rejects_stream_without_header():
    chunks = _stream(_state(w=W))
    chunks[0].ClearField("header")
    _raises(chunks, r"stream does not start with a header")


def test_rejects_empty_stream():
    _raises([], r"empty stream: no header received")


def test_rejects_second_header():
    chunks = _stream(_state(w=W, b=B))
    chunks[1].header.CopyFrom(chunks[0].header)
    _raises(chunks, r"stream carries a second header")


def test_rejects_duplicate_tensor():
    first = _stream(_state(w=W))
    second = _stream(_state(w=W))
    first[0].header.num_tensors = 2
    first[0].header.total_bytes = 48
    second[0].ClearField("header")
    _raises(first + second, r"tensor 'w' sent twice")


def test_rejects_data_before_any_tensor():
    chunks = [pb.Chunk(header=pb.StreamHeader(num_tensors=1, total_bytes=4)), pb.Chunk(data=b"abcd")]
    _raises(chunks, r"data chunk before any tensor header")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_rejects_non_finite_header_metric(value):
    chunks = _stream(_state(w=W), metrics={"loss": value})
    _raises(chunks, rf"metric 'loss' is {value}")


def test_rejections_are_invalid_update_errors():
    assert issubclass(PayloadTooLargeError, InvalidUpdateError)
    assert issubclass(InvalidUpdateError, ValueError)


# -- check_finite --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64], ids=str
)
@pytest.mark.parametrize("bad,word", [(math.nan, "NaN"), (math.inf, "Inf"), (-math.inf, "Inf")])
def test_check_finite_names_tensor(dtype, bad, word):
    ok = torch.ones(4, dtype=dtype)
    broken = torch.zeros(3, 3, dtype=dtype)
    broken[1, 2] = bad
    with pytest.raises(InvalidUpdateError, match=rf"tensor 'layer.weight': contains {word}"):
        serde.check_finite(_state(ok=ok, **{"layer.weight": broken}, later=broken.clone()))


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz], ids=str
)
def test_check_finite_float8_nan(dtype):
    t = torch.tensor([1.0, math.nan, 2.0]).to(dtype)
    with pytest.raises(InvalidUpdateError, match=r"tensor 'q': contains NaN"):
        serde.check_finite({"q": t})
    serde.check_finite({"q": torch.tensor([1.0, -2.0, 0.0]).to(dtype)})


def test_check_finite_float8_e5m2_inf():
    t = torch.tensor([1.0, math.inf]).to(torch.float8_e5m2)
    with pytest.raises(InvalidUpdateError, match=r"tensor 'q': contains Inf"):
        serde.check_finite({"q": t})


def test_check_finite_accepts_finite_integer_and_empty():
    serde.check_finite(
        _state(
            f=torch.tensor([1e38, -1e38], dtype=torch.float32),
            h=torch.tensor([65504.0], dtype=torch.float16),
            i=torch.tensor([-(2**62)], dtype=torch.int64),
            b=torch.tensor([True, False]),
            e=torch.empty((0, 5), dtype=torch.float32),
        )
    )


# -- small messages ------------------------------------------------------------------------
def test_config_roundtrip_keeps_types():
    config = {
        "flag": True,
        "off": False,
        "epochs": 3,
        "neg": -(2**62),
        "zero": 0,
        "lr": 0.1,
        "nz": 0.0,
        "name": "adam",
        "empty": "",
    }
    task = pb.Task(config=serde.config_to_pb(config))
    back = serde.config_from_pb(pb.Task.FromString(task.SerializeToString()).config)
    assert back == config
    assert {k: type(v) for k, v in back.items()} == {k: type(v) for k, v in config.items()}


def test_config_from_pb_unset_scalar_is_none():
    assert serde.config_from_pb(pb.Task(config={"k": pb.Scalar()}).config) == {"k": None}


@pytest.mark.parametrize("value", [None, [1], {"a": 1}, b"x"])
def test_config_to_pb_rejects_non_scalars(value):
    with pytest.raises(TypeError, match="task config 'k'"):
        serde.config_to_pb({"k": value})


def test_fit_ins_from_task():
    task = pb.Task(
        task_id="t", round=4, kind=pb.FIT, config=serde.config_to_pb({"lr": 0.5, "local_epochs": 2})
    )
    ins = serde.fit_ins_from_task(task)
    assert ins.round == 4
    assert dict(ins.config) == {"lr": 0.5, "local_epochs": 2}


def test_client_info_join_roundtrip():
    info = ClientInfo(
        client_id="ignored",
        name="n",
        region="eu",
        num_examples=50,
        device="cuda",
        num_accelerators=2,
        memory_bytes=1 << 30,
        codecs=("none", "q8"),
    )
    request = pb.JoinRequest(
        name="n", region="eu", num_examples=50, capabilities=serde.capabilities_to_pb(info)
    )
    got = serde.client_info_from_join("c-1", request)
    assert got == ClientInfo(
        client_id="c-1",
        name="n",
        region="eu",
        num_examples=50,
        device="cuda",
        num_accelerators=2,
        memory_bytes=1 << 30,
        codecs=("none", "q8"),
    )


def test_client_info_from_bare_join_defaults():
    got = serde.client_info_from_join("c-2", pb.JoinRequest())
    assert got.device == "cpu" and got.codecs == ("none",) and got.num_examples == 0


def test_small_frames_travel_several_a_message_and_read_back_in_order():
    """``serde.batched``: a model of many small tensors goes as few gRPC messages (each one a hop
    between threads at both ends); ``unbatched`` gives back the very frames, and a stream of
    single frames (a client that sends them one by one) reads as it is."""
    state = OrderedDict((f"t{i}", torch.full((i + 1, 8), float(i))) for i in range(21))
    state["big"] = torch.arange(5000, dtype=torch.float32)  # 20,000 bytes: 3 frames of 8 KiB
    frames = list(serde.EncodedModel(state).frames(serde.StreamInfo(round=3), chunk_size=8192))
    messages = list(serde.batched(frames, 8192))
    # The 21 small tensors (7 kB) in one message, then the big one's three frames, each alone.
    assert len(frames) == 24 and len(messages) == 4, [len(m) for m in messages]
    assert all(len(m) <= 8192 for m in messages if m not in frames)  # a batch stays within the limit
    assert messages[0][:1] == b"\x00" and messages[1:] == frames[21:]
    assert list(serde.unbatched(messages)) == frames
    assert list(serde.unbatched(frames)) == frames
    info, decoded = serde.decode_chunks(list(serde.unbatched(messages)))
    assert info.round == 3 and all(torch.equal(decoded[k], v) for k, v in state.items())
    # One frame alone is that frame; a batch whose lengths run past its end is refused.
    assert list(serde.batched(frames[:1], 8192)) == frames[:1]
    with pytest.raises(InvalidUpdateError, match="runs past the end of its batch"):
        list(serde.unbatched([messages[0][:-1]]))
