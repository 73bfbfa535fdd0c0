"""Payloads that lie: every decoder rejects them with ``InvalidUpdateError`` naming the problem."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from fedgrid.compression import get_codec
from fedgrid.compression._payload import pack_uint, rice_encode
from fedgrid.errors import InvalidUpdateError

F32 = torch.float32
SPECS = [
    "fp16",
    "bf16",
    "int8",
    "qsgd:5",
    "qsgd:300",
    "topk:0.05",
    "randk:0.3",
    "powersgd:2",
    "sign",
    "none+zstd",
    "int8+zstd",
    "topk:0.05+zstd",
]


def _x(shape: tuple[int, ...] = (40, 30), seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _encode(spec: str, x: torch.Tensor) -> bytes:
    return bytes(get_codec(spec).encode(x, generator=torch.Generator().manual_seed(0)))


def _rejects(
    spec: str,
    payload: bytes | bytearray,
    match: str,
    *,
    shape: tuple[int, ...] = (40, 30),
    dtype: torch.dtype = F32,
) -> None:
    with pytest.raises(InvalidUpdateError, match=match):
        get_codec(spec).decode(bytearray(payload), dtype=dtype, shape=shape)


def _sparse(k: int, fmt: int, index_bytes: bytes, *, values: int | None = None) -> bytes:
    """A hand-made coded topk/randk payload of float32 ones."""
    return (
        bytes([0])
        + k.to_bytes(8, "little")
        + np.ones(values if values is not None else k, "<f4").tobytes()
        + bytes([fmt])
        + index_bytes
    )


# topk:0.01 of 1000 elements keeps k = 10; fixed-width indices are uint16.
N, K = (1000,), 10


def test_sparse_payload_builder_matches_the_codec() -> None:
    idx = np.arange(0, 1000, 100, dtype="<u2")
    y = get_codec("topk:0.01").decode(bytearray(_sparse(K, 0, idx.tobytes())), dtype=F32, shape=N)
    assert torch.equal(torch.nonzero(y).reshape(-1), torch.from_numpy(idx.astype(np.int64)))


@pytest.mark.parametrize(
    "index_bytes,fmt,match",
    [
        (
            np.array([0, 5, 1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007], "<u2").tobytes(),
            0,
            r"index 1007 out of range for 1000 elements",
        ),
        (np.array([0, 5, 5, 6, 7, 8, 9, 10, 11, 12], "<u2").tobytes(), 0, r"not strictly increasing"),
        (np.array([9, 5, 6, 7, 8, 10, 11, 12, 13, 14], "<u2").tobytes(), 0, r"not strictly increasing"),
        (bytes([0x7F] * 9 + [0xE8, 0x07]), 2, r"index gap 1000 out of range for 1000 elements"),
        (bytes([100] * 10), 2, r"index 1009 out of range for 1000 elements"),
        (bytes([1] * 9 + [0x81]), 2, r"holds 9 indices, header says 10"),
        (bytes([1] * 10 + [0x81]), 2, r"holds 10 indices, header says 10|unterminated"),
        (bytes([0x80, 0x80, 0x80, 0x01] + [1] * 9), 2, r"gap is 4 bytes, 1000 elements need at most 2"),
        (b"\x00" * 20, 7, r"unknown index format 7"),
        (np.arange(9, dtype="<u2").tobytes(), 0, r"index section is 18 bytes, 10 indices of 2 bytes need 20"),
        (
            bytes([0]) + b"\xff" * 125,
            3,
            r"payload is 176 bytes, over the 70 a torch.float32 \[1000\] tensor allows",
        ),
        (rice_encode(np.full(10, 127, dtype=np.uint64)), 3, r"index 1279 out of range for 1000 elements"),
        (bytes([11]) + bytes(16), 3, r"rice parameter 11 is over the 10 bits a gap needs"),
        (bytes([0]) + b"\xff\xff", 3, r"truncated indices: 0 unary codes, 10 expected"),
        (bytes([9]) + pack_uint(np.full(10, 500, dtype=np.uint64), 9) + b"\x03\x00", 3, r"a gap is over 999"),
    ],
    ids=[
        "fixed-out-of-range",
        "fixed-duplicate",
        "fixed-unsorted",
        "varint-gap-out-of-range",
        "varint-sum-out-of-range",
        "varint-short-count",
        "varint-unterminated",
        "varint-overlong",
        "unknown-format",
        "fixed-length",
        "rice-oversized",
        "rice-sum-out-of-range",
        "rice-parameter",
        "rice-short-count",
        "rice-gap-out-of-range",
    ],
)
def test_sparse_indices_are_checked(index_bytes: bytes, fmt: int, match: str) -> None:
    _rejects("topk:0.01", _sparse(K, fmt, index_bytes), match, shape=N)
    _rejects("randk:0.01", _sparse(K, fmt, index_bytes), match, shape=N)


def test_sparse_indices_of_a_large_tensor_go_rice_coded_near_their_entropy() -> None:
    """topk:0.01 of 2**20 elements: the Rice code of the gaps (format 3) beats LEB128 varints
    (1-2 bytes a gap) and fixed width (4 bytes), within 5% of log2 C(n, k) bits."""
    n = 1 << 20
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    codec = get_codec("topk:0.01")
    payload = bytes(codec.encode(x))
    k = codec.k_for(n)
    index_section = payload[1 + 8 + 4 * k :]
    assert index_section[0] == 3
    idx = torch.topk(x.abs(), k).indices.sort().values.numpy()
    gaps = (np.diff(idx, prepend=-1) - 1).astype(np.uint64)
    assert len(index_section) < sum(1 if g < 128 else 2 for g in gaps)
    entropy = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
    assert 8 * len(index_section) <= 1.05 * entropy
    y = codec.decode(bytearray(payload), dtype=F32, shape=(n,))
    assert np.array_equal(torch.nonzero(y).reshape(-1).numpy(), idx)
    assert torch.equal(y[idx], x[idx])


def test_bitmaps_are_checked() -> None:
    # topk:0.1 of 1000 keeps 100: a bitmap (125 bytes) beats uint16 indices (200 bytes).
    assert get_codec("topk:0.1").max_payload_bytes(dtype=F32, shape=N) == 1 + 8 + 400 + 1 + 125
    bits = np.zeros(1000, dtype=np.uint8)
    bits[:100] = 1
    good = np.packbits(bits, bitorder="little").tobytes()
    assert len(good) == 125
    y = get_codec("topk:0.1").decode(bytearray(_sparse(100, 1, good)), dtype=F32, shape=N)
    assert torch.equal(y, (torch.arange(1000) < 100).float())
    _rejects(
        "topk:0.1", _sparse(100, 1, good[:-1]), r"index bitmap is 124 bytes, 1000 elements need 125", shape=N
    )
    bits[100] = 1
    _rejects(
        "topk:0.1",
        _sparse(100, 1, np.packbits(bits, bitorder="little").tobytes()),
        r"index bitmap marks 101 elements, header says 100",
        shape=N,
    )
    bits = np.zeros(1001, dtype=np.uint8)
    bits[:100] = 1
    padded = bytearray(np.packbits(bits, bitorder="little").tobytes())
    padded[-1] |= 0x80  # bit 1007, past the 1001 elements
    _rejects(
        "topk:0.1", _sparse(100, 1, bytes(padded)), r"index bitmap: padding bits are not zero", shape=(1001,)
    )


def test_header_length_mismatch() -> None:
    idx = np.arange(9, dtype="<u2").tobytes()
    _rejects(
        "topk:0.01",
        _sparse(9, 0, idx),
        r"header count is 9, the codec spec and tensor shape imply 10",
        shape=N,
    )
    x = _x()
    good = bytearray(_encode("int8", x))
    good[1:5] = (128).to_bytes(4, "little")
    _rejects("int8", good, r"header block size is 128, the codec spec and tensor shape imply 256")
    good = bytearray(_encode("qsgd:5", x))
    good[1:3] = (6).to_bytes(2, "little")
    _rejects("qsgd:5", good, r"header level count is 6")
    # A payload of one spec read under another disagrees with its own header.
    _rejects("int8:128", _encode("int8", x), r"header block size is 256, .* imply 128")
    _rejects("qsgd:7", _encode("qsgd:5", x), r"header level count is 5, .* imply 7")


def test_rank_mismatch() -> None:
    x = _x((64, 48))
    good = bytearray(_encode("powersgd:2", x))
    good[1:3] = (3).to_bytes(2, "little")
    _rejects("powersgd:2", good, r"header rank is 3, the codec spec and tensor shape imply 2", shape=(64, 48))
    _rejects("powersgd:3", _encode("powersgd:2", x), r"over the|header rank is 2", shape=(64, 48))
    _rejects("powersgd:1", _encode("powersgd:2", x), r"over the .* allows", shape=(64, 48))


@pytest.mark.parametrize("spec", SPECS)
def test_truncated_payloads(spec: str) -> None:
    x = _x()
    payload = _encode(spec, x)
    for cut in sorted({0, 1, 2, 5, len(payload) // 2, len(payload) - 1}):
        if cut < len(payload):
            with pytest.raises(InvalidUpdateError):
                get_codec(spec).decode(bytearray(payload[:cut]), dtype=F32, shape=(40, 30))
    if "zstd" not in spec:
        _rejects(spec, payload[:-1], r"truncated|needs|is \d+ bytes")


@pytest.mark.parametrize("spec", SPECS)
def test_decoded_size_over_declared(spec: str) -> None:
    x = _x()
    payload = _encode(spec, x)
    codec = get_codec(spec)
    limit = codec.max_payload_bytes(dtype=F32, shape=(40, 30))
    assert len(payload) <= limit
    _rejects(
        spec,
        payload + b"\x00" * (limit - len(payload) + 1),
        r"over the \d+ a torch.float32 \[40, 30\] tensor allows",
    )
    # The same bytes declared as a smaller tensor: the header or length gives it away.
    with pytest.raises(InvalidUpdateError):
        codec.decode(bytearray(payload), dtype=F32, shape=(20, 30))


@pytest.mark.parametrize("spec", ["int8", "qsgd:5", "sign", "topk:0.05", "powersgd:2", "fp16"])
def test_trailing_bytes_are_rejected(spec: str) -> None:
    payload = _encode(spec, _x())
    assert payload[0] == 0
    if len(payload) + 1 <= get_codec(spec).max_payload_bytes(dtype=F32, shape=(40, 30)):
        _rejects(spec, payload + b"\x00", r"trailing bytes|index section is|holds \d+ indices|needs")


def test_zstd_frame_that_decompresses_past_the_declared_tensor() -> None:
    limit = get_codec("int8").max_payload_bytes(dtype=F32, shape=(40, 30))
    bomb = bytes([1]) + zstandard.ZstdCompressor().compress(b"\x00" * (limit + 1))
    _rejects("int8+zstd", bomb, rf"decompresses to {limit + 1} bytes, over the {limit}")
    huge = bytes([1]) + zstandard.ZstdCompressor().compress(b"\x00" * (1 << 24))
    _rejects("none+zstd", huge, r"decompresses to 16777216 bytes, over the 4800")
    cobj = zstandard.ZstdCompressor().compressobj()
    unsized = bytes([1]) + cobj.compress(b"\x00" * 100) + cobj.flush()
    _rejects("none+zstd", unsized, r"does not declare its content size")
    _rejects("none+zstd", bytes([1]) + b"not a zstd frame at all", r"corrupt zstd frame")
    frame = zstandard.ZstdCompressor().compress(b"\x00" * 4800)
    _rejects("none+zstd", bytes([1]) + frame + b"xx", r"corrupt zstd frame")
    _rejects("none+zstd", bytes([1]) + frame[:-3], r"corrupt zstd frame")
    _rejects("none+zstd", bytes([9]) + frame, r"unknown flag byte 9")
    odd = bytes([2]) + zstandard.ZstdCompressor().compress(b"\x00" * 4799)
    _rejects("none+zstd", odd, r"not whole 4-byte elements")


def test_mode_bytes_and_values_are_checked() -> None:
    x = _x()
    _rejects("int8", bytes([5]) + _encode("int8", x)[1:], r"unknown mode byte 5")
    _rejects(
        "int8", bytes([1]) + b"\x00" * 100, r"raw payload is 100 bytes, torch.float32 \[40, 30\] needs 4800"
    )
    _rejects(
        "powersgd:2",
        bytes([0]) + b"\x00" * 50,
        r"coded form for a torch.float32 \[40\] tensor, which this codec sends raw",
        shape=(40,),
    )
    nan_scale = bytearray(_encode("int8", x))
    nan_scale[5:9] = struct.pack("<f", float("nan"))
    _rejects("int8", nan_scale, r"block scales holds a negative or non-finite value")
    negative = bytearray(_encode("sign", x))
    negative[5:9] = struct.pack("<f", -1.0)  # after the mode byte and the u32 block size
    _rejects("sign", negative, r"scale holds a negative or non-finite value")
    code = bytearray(_encode("int8", x))
    code[-1] = 0x80
    _rejects("int8", code, r"code -128 is outside -127..127")
    levels = bytearray(_encode("qsgd:300", x))  # 16-bit codes
    levels[-2:] = (601).to_bytes(2, "little")
    _rejects("qsgd:300", levels, r"a code is over 600")
    small = bytearray(_encode("qsgd:1", _x((5,))))  # 2-bit codes, 5 of them: 6 padding bits
    small[-1] |= 0x80
    _rejects("qsgd:1", small, r"padding bits are not zero", shape=(5,))
    sign = bytearray(_encode("sign", _x((5, 9))))  # 45 elements: one rotation block of 64
    sign[1:5] = (128).to_bytes(4, "little")
    _rejects(
        "sign", sign, r"header block size is 128, the codec spec and tensor shape imply 64", shape=(5, 9)
    )
    inf = bytearray(_encode("fp16", x))
    inf[1:3] = np.array([np.inf], "<f2").tobytes()
    _rejects("fp16", inf, r"values hold NaN or Inf")
    nan_value = _sparse(K, 0, np.arange(10, dtype="<u2").tobytes())
    nan_value = nan_value[:9] + struct.pack("<f", float("nan")) + nan_value[13:]
    _rejects("topk:0.01", nan_value, r"values hold NaN or Inf", shape=N)
    factors = bytearray(_encode("powersgd:2", _x((64, 48))))
    factors[3:7] = struct.pack("<f", float("inf"))
    _rejects("powersgd:2", factors, r"factors hold NaN or Inf", shape=(64, 48))


def test_non_float_dtypes_need_their_exact_raw_size() -> None:
    _rejects(
        "int8",
        b"\x00" * 7,
        r"raw payload is 7 bytes, torch.int64 \[1\] needs 8",
        shape=(1,),
        dtype=torch.int64,
    )
    _rejects("topk:0.1", b"\x00" * 9, r"over the 8", shape=(1,), dtype=torch.int64)
    _rejects("sign", b"\x00", r"over the 0", shape=(0,))


def test_unknown_codec() -> None:
    with pytest.raises(InvalidUpdateError, match=r"unknown codec 'foo' \(known: none"):
        get_codec("foo")
    with pytest.raises(InvalidUpdateError, match=r"unknown codec 'lz4'"):
        get_codec("lz4:3+zstd")


@pytest.mark.parametrize("spec", SPECS)
@settings(deadline=None, max_examples=30)
@given(data=st.data())
def test_mutated_payloads_raise_only_invalid_update_error(spec: str, data: st.DataObject) -> None:
    shape = data.draw(st.sampled_from([(40, 30), (7,), (300,), (3, 4, 5)]))
    payload = bytearray(_encode(spec, _x(shape)))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "grow"]))
        if op == "flip" and payload:
            i = data.draw(st.integers(0, len(payload) - 1))
            payload[i] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del payload[data.draw(st.integers(0, len(payload))) :]
        else:
            payload += bytes(data.draw(st.binary(max_size=8)))
    try:
        y = get_codec(spec).decode(payload, dtype=F32, shape=shape)
    except InvalidUpdateError:
        return
    assert y.dtype == F32 and tuple(y.shape) == shape
