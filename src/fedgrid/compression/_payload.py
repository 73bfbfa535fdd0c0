"""Byte-level helpers shared by the codecs: a validating reader, bit packing, float blocks and
their scales, fixed-width codes, sparse index coding.

Every reader method checks a length before it slices, so a truncated or lying payload
raises ``InvalidUpdateError`` naming what was missing instead of reading past the end or
allocating from an unchecked header field. All multi-byte fields are little-endian.
"""

from __future__ import annotations

import math
import struct
from typing import Iterator

import numpy as np
import torch

from fedgrid.errors import InvalidUpdateError

__all__ = [
    "Reader",
    "numel",
    "itemsize",
    "tensor_bytes",
    "raw_decode",
    "pack_bits",
    "as_blocks",
    "SLAB",
    "scaled_slabs",
    "nonfinite_error",
    "f32_bytes",
    "check_scales",
    "pack_codes",
    "unpack_codes",
    "unpack_bits",
    "index_width",
    "encode_indices",
    "decode_indices",
    "max_index_bytes",
    "pack_uint",
    "unpack_uint",
    "rice_param",
    "rice_encode",
    "rice_decode",
]

# Index formats of a sparse payload (one byte after the count).
IDX_FIXED, IDX_BITMAP, IDX_VARINT, IDX_RICE = 0, 1, 2, 3

_NP_UINT: dict[int, str] = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw little-endian bytes of ``tensor`` (moved to CPU, made contiguous)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def raw_decode(
    data: bytes | bytearray | memoryview, *, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """Rebuilds a tensor from its raw bytes; the length must match exactly."""
    expected = numel(shape) * itemsize(dtype)
    if len(data) != expected:
        raise InvalidUpdateError(f"raw payload is {len(data)} bytes, {dtype} {list(shape)} needs {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class Reader:
    """Reads fields off a payload, raising ``InvalidUpdateError`` on truncation.

    Args:
        data: the payload (or the part of it this codec owns).
        what: the codec's name, used in messages.
    """

    def __init__(self, data: bytes | bytearray | memoryview, what: str) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0
        self._what = what

    @property
    def remaining(self) -> int:
        return len(self._view) - self._pos

    def fail(self, problem: str) -> InvalidUpdateError:
        return InvalidUpdateError(f"{self._what} payload: {problem}")

    def take(self, nbytes: int, field: str) -> memoryview:
        if nbytes < 0 or nbytes > self.remaining:
            raise self.fail(f"truncated: {field} needs {nbytes} bytes, {self.remaining} left")
        out = self._view[self._pos : self._pos + nbytes]
        self._pos += nbytes
        return out

    def uint(self, nbytes: int, field: str) -> int:
        return int.from_bytes(self.take(nbytes, field), "little")

    def f32(self, field: str) -> float:
        value: float = struct.unpack("<f", self.take(4, field))[0]
        return value

    def array(self, dtype: str, count: int, field: str) -> np.ndarray:
        """``count`` items of numpy ``dtype`` (a copy, so torch gets a writable buffer)."""
        np_dtype = np.dtype(dtype)
        return np.frombuffer(self.take(count * np_dtype.itemsize, field), dtype=np_dtype).copy()

    def rest(self) -> memoryview:
        return self.take(self.remaining, "rest")

    def finish(self) -> None:
        if self.remaining:
            raise self.fail(f"{self.remaining} trailing bytes after the last field")

    def expect(self, nbytes: int, value: int, field: str) -> None:
        """Reads an unsigned header field that must equal what the codec spec implies."""
        got = self.uint(nbytes, field)
        if got != value:
            raise self.fail(f"header {field} is {got}, the codec spec and tensor shape imply {value}")


# -- bits ----------------------------------------------------------------------------------
def pack_bits(bits: torch.Tensor) -> bytes:
    """Packs a bool/0-1 tensor, first element in the lowest bit; the tail is zero-padded."""
    return np.packbits(bits.to("cpu", torch.uint8).numpy(), bitorder="little").tobytes()


def unpack_bits(data: memoryview, count: int, reader: Reader, field: str) -> np.ndarray:
    """Unpacks ``count`` bits; padding bits past ``count`` must be zero."""
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    if bits[count:].any():
        raise reader.fail(f"{field}: padding bits are not zero")
    return bits[:count]


def pack_uint(values: np.ndarray, bits: int) -> bytes:
    """``values`` (each < 2**bits, bits <= 63) bit-packed, the first in the lowest bits."""
    shifts = np.arange(bits, dtype=np.uint64)
    planes = ((values.astype(np.uint64)[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def unpack_uint(reader: Reader, count: int, bits: int, field: str) -> np.ndarray:
    """Reads what ``pack_uint`` wrote: ``count`` unsigned ``bits``-bit values (uint64); padding must be zero."""
    nbytes = math.ceil(count * bits / 8)
    planes = np.unpackbits(np.frombuffer(reader.take(nbytes, field), dtype=np.uint8), bitorder="little")
    if planes[count * bits :].any():
        raise reader.fail(f"{field}: padding bits are not zero")
    weights = np.left_shift(np.uint64(1), np.arange(bits, dtype=np.uint64))
    return (planes[: count * bits].reshape(count, bits).astype(np.uint64) * weights).sum(
        axis=1, dtype=np.uint64
    )


# -- float blocks, scales and fixed-width codes (int8, int4, fp4, qsgd, sign, sparseloco) ----------


def as_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` flattened to float32, zero-padded to whole blocks, as (blocks, block)."""
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.reshape(-1, block)


#: Elements a block codec scales at a time on a CPU: its scratch buffer stays in the core's cache
#: and is allocated once per tensor. Whole-tensor passes ran at 0.3 GB/s, most of it the page
#: faults of a fresh full-size buffer for each intermediate (``abs``, the product, the codes).
SLAB = 1 << 18


def nonfinite_error(codec: str) -> InvalidUpdateError:
    """What a lossy codec raises for a tensor holding NaN or Inf."""
    return InvalidUpdateError(f"codec '{codec}' encodes finite tensors only; this one holds NaN or Inf")


def scaled_slabs(
    x: torch.Tensor, block: int, numerator: float, codec: str
) -> tuple[torch.Tensor, Iterator[tuple[int, torch.Tensor]]]:
    """``x`` as ``as_blocks(x, block)``, each block multiplied by ``numerator / absmax`` (0 where
    the block is all zeros), a slab of whole blocks at a time.

    Returns the block absmax (float32, filled as the slabs are taken) and an iterator of
    ``(first element, scaled slab)``. A slab is a scratch buffer of (rows, block), rows even,
    reused for the next slab: use it (it may be modified in place) before taking the next.

    Raises:
        InvalidUpdateError: (while iterating) ``x`` holds NaN or Inf; the absmax carries them,
            so no separate pass looks for them (``FloatCodec.checks_finite``).
    """
    blocks = as_blocks(x, block)
    nblocks = blocks.shape[0]
    absmax = torch.empty(nblocks, device=blocks.device)
    rows = nblocks if blocks.device.type != "cpu" else max(2, SLAB // block)
    rows += rows % 2  # slabs of an even length pack whole bytes of 4-bit codes

    def slabs() -> Iterator[tuple[int, torch.Tensor]]:
        buf = torch.empty(min(rows, nblocks), block, device=blocks.device)
        for i in range(0, nblocks, rows):
            part = blocks[i : i + rows]
            scratch = buf[: part.shape[0]]
            scale = absmax[i : i + rows]
            torch.amax(torch.abs(part, out=scratch), dim=1, out=scale)
            if not bool(torch.isfinite(scale).all()):
                raise nonfinite_error(codec)
            inv = torch.where(scale > 0, numerator / scale, torch.zeros_like(scale))
            yield i * block, torch.mul(part, inv[:, None], out=scratch)

    return absmax, slabs()


def f32_bytes(t: torch.Tensor) -> bytes:
    """``t`` as little-endian float32 bytes (scales and norms travel so)."""
    return t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()


def check_scales(reader: Reader, scales: np.ndarray, field: str) -> torch.Tensor:
    """``scales`` as a tensor, once each is finite and not negative (else ``reader.fail`` names ``field``)."""
    if not bool(np.isfinite(scales).all()) or bool((scales < 0).any()):
        raise reader.fail(f"{field} holds a negative or non-finite value")
    return torch.from_numpy(scales)


def pack_codes(codes: torch.Tensor, bits: int) -> bytes:
    """Packs unsigned codes of ``bits`` bits each, the first in the lowest bits."""
    if bits == 16:
        return codes.to("cpu", torch.int32).numpy().astype("<u2").tobytes()
    c = codes.to(torch.uint8)
    if bits == 8:
        return c.to("cpu").numpy().tobytes()
    per = 8 // bits
    c = torch.nn.functional.pad(c, (0, (-c.numel()) % per)).reshape(-1, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=c.device)
    return (c << shifts).sum(dim=1, dtype=torch.uint8).to("cpu").numpy().tobytes()


def unpack_codes(reader: Reader, n: int, bits: int) -> torch.Tensor:
    """Reads what ``pack_codes`` wrote: ``n`` codes of ``bits`` bits (int32); padding must be zero."""
    if bits == 16:
        return torch.from_numpy(reader.array("<u2", n, "codes").astype(np.int32))
    per = 8 // bits
    raw = torch.from_numpy(reader.array("u1", math.ceil(n / per), "codes"))
    if bits == 8:
        return raw.to(torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    codes = ((raw[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)
    if bool(codes[n:].any()):
        raise reader.fail("codes: padding bits are not zero")
    return codes[:n].to(torch.int32)


# -- Golomb-Rice codes ---------------------------------------------------------------------
# The gaps between sorted sparse indices are close to geometric, for which a Golomb-Rice code
# (Rice 1979) is within a few percent of the entropy: gap g costs r + 1 + (g >> r) bits
# (its low r bits, then g >> r in unary). Templar's SparseLoCo sends its top-k indices so.
def rice_param(gaps: np.ndarray) -> tuple[int, int]:
    """The parameter ``r`` giving the fewest bits for ``gaps`` (uint64), and those bits."""
    if not len(gaps):
        return 0, 0
    best = (0, 0)
    for r in range(int(gaps.max()).bit_length() + 1):
        bits = len(gaps) * (r + 1) + int((gaps >> np.uint64(r)).sum())
        if r == 0 or bits < best[1]:
            best = (r, bits)
    return best


def rice_encode(gaps: np.ndarray, r: int | None = None) -> bytes:
    """Golomb-Rice code of non-negative ``gaps``: one byte ``r``, the low ``r`` bits of each gap
    (``pack_uint``), then each ``gap >> r`` in unary (that many 1 bits and a 0), bit-packed,
    zero-padded. ``r`` is ``rice_param``'s unless the caller has it. Meant to end a payload:
    ``rice_decode`` reads the rest."""
    gaps = gaps.astype(np.uint64)
    if r is None:
        r, _ = rice_param(gaps)
    quotients = (gaps >> np.uint64(r)).astype(np.int64)
    unary = np.ones(int(quotients.sum()) + len(gaps), dtype=np.uint8)
    unary[np.cumsum(quotients + 1) - 1] = 0
    low = pack_uint(gaps & np.uint64((1 << r) - 1), r) if r else b""
    return bytes([r]) + low + np.packbits(unary, bitorder="little").tobytes()


def rice_decode(reader: Reader, count: int, max_gap: int, field: str) -> np.ndarray:
    """Reads what ``rice_encode`` wrote (the rest of the payload): ``count`` gaps, each checked
    to be at most ``max_gap``, as uint64.

    Raises:
        InvalidUpdateError: ``r`` larger than ``max_gap`` needs, a unary section with too few
            terminators or bytes past the last one, a gap over ``max_gap``, or truncation.
    """
    r = reader.uint(1, f"{field} rice parameter")
    if r > max(max_gap, 1).bit_length():
        raise reader.fail(
            f"{field}: rice parameter {r} is over the {max(max_gap, 1).bit_length()} bits a gap needs"
        )
    low = unpack_uint(reader, count, r, f"{field} low bits") if r else np.zeros(count, dtype=np.uint64)
    bits = np.unpackbits(np.frombuffer(reader.rest(), dtype=np.uint8), bitorder="little")
    ends = np.flatnonzero(bits == 0)
    if len(ends) < count:
        raise reader.fail(f"truncated {field}: {len(ends)} unary codes, {count} expected")
    if count == 0:
        if len(bits):
            raise reader.fail(f"{field}: {len(bits) // 8} bytes for zero codes")
        return low
    ends = ends[:count]
    used = int(ends[-1]) + 1
    if len(bits) != 8 * math.ceil(used / 8):
        raise reader.fail(
            f"{field}: {len(bits) // 8 - math.ceil(used / 8)} trailing bytes after the last unary code"
        )
    if bits[used:].any():
        raise reader.fail(f"{field}: padding bits are not zero")
    quotients = np.diff(ends, prepend=-1) - 1
    if int(quotients.max()) > max_gap >> r:
        raise reader.fail(f"{field}: a gap is over {max_gap}")
    gaps = (quotients.astype(np.uint64) << np.uint64(r)) | low
    if int(gaps.max()) > max_gap:
        raise reader.fail(f"{field}: a gap is over {max_gap}")
    return gaps


# -- sparse indices ------------------------------------------------------------------------
def index_width(n: int) -> int:
    """Bytes per index in the fixed-width format: the smallest of 1, 2, 4, 8 holding ``n - 1``."""
    for width in (1, 2, 4):
        if n <= 1 << (8 * width):
            return width
    return 8


def max_index_bytes(n: int, k: int) -> int:
    """Largest index section of ``k`` of ``n`` indices (the encoder never picks a larger format)."""
    return min(k * index_width(n), (n + 7) // 8)


def _varint_lengths(values: np.ndarray) -> np.ndarray:
    lengths = np.ones(values.shape, dtype=np.int64)
    for j in range(1, 10):
        lengths += values >= (np.uint64(1) << np.uint64(7 * j))
    return lengths


def _varint_encode(values: np.ndarray, lengths: np.ndarray) -> bytes:
    out = np.zeros(int(lengths.sum()), dtype=np.uint8)
    starts = np.cumsum(lengths) - lengths
    for j in range(int(lengths.max(initial=0))):
        sel = lengths > j
        chunk = (values[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = (lengths[sel] - 1 > j).astype(np.uint64) << np.uint64(7)
        out[starts[sel] + j] = (chunk | more).astype(np.uint8)
    return out.tobytes()


def encode_indices(indices: np.ndarray, n: int) -> bytes:
    """Sorted, unique int64 ``indices`` < ``n`` in the smallest of three formats, tagged by a byte.

    Formats: fixed-width little-endian integers; a bitmap of ``n`` bits; LEB128 varints of the
    gaps (``idx[i] - idx[i-1] - 1``, the first index as is); a Golomb-Rice code of the gaps
    (``rice_encode``). Ties prefer the earlier format.
    """
    k = len(indices)
    width = index_width(n)
    gaps = np.diff(indices, prepend=-1).astype(np.uint64) - np.uint64(1)
    lengths = _varint_lengths(gaps)
    r, rice_bits = rice_param(gaps)
    sizes = {
        IDX_FIXED: k * width,
        IDX_BITMAP: (n + 7) // 8,
        IDX_VARINT: int(lengths.sum()),
        IDX_RICE: 1 + math.ceil(k * r / 8) + math.ceil((rice_bits - k * r) / 8),
    }
    fmt = min(sizes, key=lambda f: (sizes[f], f))
    if fmt == IDX_FIXED:
        body = indices.astype(_NP_UINT[width]).tobytes()
    elif fmt == IDX_BITMAP:
        mask = np.zeros(n, dtype=np.uint8)
        mask[indices] = 1
        body = np.packbits(mask, bitorder="little").tobytes()
    elif fmt == IDX_VARINT:
        body = _varint_encode(gaps, lengths)
    else:
        body = rice_encode(gaps, r)
    return bytes([fmt]) + body


def decode_indices(reader: Reader, n: int, k: int) -> np.ndarray:
    """Reads what ``encode_indices`` wrote (the rest of the payload) and checks every index.

    Returns sorted, unique int64 indices, all < ``n``, exactly ``k`` of them.

    Raises:
        InvalidUpdateError: unknown format, wrong count, out-of-range or unsorted indices,
            a section longer than the format allows, or truncation.
    """
    fmt = reader.uint(1, "index format")
    if fmt == IDX_FIXED:
        width = index_width(n)
        if reader.remaining != k * width:
            raise reader.fail(
                f"index section is {reader.remaining} bytes, {k} indices of {width} bytes need {k * width}"
            )
        idx = reader.array(_NP_UINT[width], k, "indices").astype(np.int64)
        if k and int(idx.max()) >= n:
            raise reader.fail(f"index {int(idx.max())} out of range for {n} elements")
        if k > 1 and bool((idx[1:] <= idx[:-1]).any()):
            raise reader.fail("indices are not strictly increasing")
        return idx
    if fmt == IDX_BITMAP:
        nbytes = (n + 7) // 8
        if reader.remaining != nbytes:
            raise reader.fail(f"index bitmap is {reader.remaining} bytes, {n} elements need {nbytes}")
        bits = unpack_bits(reader.rest(), n, reader, "index bitmap")
        count = int(bits.sum())
        if count != k:
            raise reader.fail(f"index bitmap marks {count} elements, header says {k}")
        return np.flatnonzero(bits).astype(np.int64)
    if fmt == IDX_VARINT:
        return _varint_decode(reader, n, k)
    if fmt == IDX_RICE:
        if reader.remaining > max_index_bytes(n, k):
            raise reader.fail(
                f"rice index section is {reader.remaining} bytes, over the {max_index_bytes(n, k)} allowed"
            )
        gaps = rice_decode(reader, k, max(n - 1, 0), "indices")
        return _gaps_to_indices(reader, gaps, n, k)
    raise reader.fail(f"unknown index format {fmt}")


def _varint_decode(reader: Reader, n: int, k: int) -> np.ndarray:
    # A varint stream is never longer than the fixed-width or bitmap forms (the encoder picks
    # the smallest), which also bounds the working memory below.
    if reader.remaining > max_index_bytes(n, k):
        raise reader.fail(
            f"varint index section is {reader.remaining} bytes, over the {max_index_bytes(n, k)} allowed"
        )
    data = np.frombuffer(reader.rest(), dtype=np.uint8)
    if k == 0:
        if len(data):
            raise reader.fail("index bytes for zero indices")
        return np.zeros(0, dtype=np.int64)
    last = (data & 0x80) == 0
    count = int(last.sum())
    if count != k:
        problem = "truncated index stream: " if count < k else ""
        raise reader.fail(f"{problem}index stream holds {count} indices, header says {k}")
    if not last[-1]:
        raise reader.fail("truncated index stream: the last varint is unterminated")
    ends = np.flatnonzero(last)
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    max_len = max(1, math.ceil(max(n - 1, 1).bit_length() / 7))
    if int(lengths.max()) > max_len:
        raise reader.fail(
            f"a varint index gap is {int(lengths.max())} bytes, {n} elements need at most {max_len}"
        )
    pos = np.arange(len(data), dtype=np.uint64) - np.repeat(starts, lengths).astype(np.uint64)
    parts = (data & 0x7F).astype(np.uint64) << (np.uint64(7) * pos)
    gaps = np.add.reduceat(parts, starts)
    if int(gaps.max()) >= n:
        raise reader.fail(f"index gap {int(gaps.max())} out of range for {n} elements")
    return _gaps_to_indices(reader, gaps, n, k)


def _gaps_to_indices(reader: Reader, gaps: np.ndarray, n: int, k: int) -> np.ndarray:
    """Indices from their gaps (each < ``n``), checked to stay under ``n``."""
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    idx = np.cumsum(gaps + np.uint64(1)) - np.uint64(1)
    # Each step adds at most n, far under 2**63, so a wrap-around shows as a decrease.
    if k > 1 and bool((idx[1:] <= idx[:-1]).any()):
        raise reader.fail(f"indices overflow past {n} elements")
    if int(idx[-1]) >= n:
        raise reader.fail(f"index {int(idx[-1])} out of range for {n} elements")
    return idx.astype(np.int64)
