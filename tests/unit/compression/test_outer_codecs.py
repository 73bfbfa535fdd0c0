"""The outer-gradient codecs: int4 and fp4 (4 bits, per-block absmax) and sparseloco (top-k per
chunk, 2-bit values): their stated bounds, checked over many draws, their sizes and their payload checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedgrid.compression import FP4Codec, Int4Codec, SparseLoCoCodec, get_codec
from fedgrid.compression._payload import pack_uint, rice_encode, rice_param
from fedgrid.compression.base import MODE_CODED
from fedgrid.compression.lowbit import E2M1
from fedgrid.compression.sparseloco import CHUNK
from fedgrid.errors import InvalidUpdateError


def _roundtrip(spec: str, x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    codec = get_codec(spec)
    payload = bytes(codec.encode(x))
    assert len(payload) <= codec.max_payload_bytes(dtype=x.dtype, shape=tuple(x.shape))
    return payload, codec.decode(bytearray(payload), dtype=x.dtype, shape=tuple(x.shape))


def _draws(count: int = 100, n: int = 2000) -> list[torch.Tensor]:
    """Gaussian and heavy-tailed (Gaussian times U^4) tensors, as pseudo-gradients are."""
    gen = torch.Generator().manual_seed(9)
    out = []
    for i in range(count):
        x = torch.randn(n, generator=gen, dtype=torch.float64)
        out.append((x * torch.rand(n, generator=gen, dtype=torch.float64) ** 4 if i % 2 else x).float())
    return out


@pytest.mark.parametrize("spec,block", [("int4", 256), ("int4:32", 32), ("fp4", 256), ("fp4:64", 64)])
def test_4bit_codecs_hold_their_bound_on_every_element_of_100_draws(spec: str, block: int) -> None:
    worst, energy = 0.0, []
    for x in _draws():
        payload, y = _roundtrip(spec, x)
        n = x.numel()
        assert len(payload) == 1 + 4 + 4 * math.ceil(n / block) + math.ceil(n / 2)
        absmax = torch.nn.functional.pad(x.abs(), (0, (-n) % block)).reshape(-1, block).amax(dim=1)
        a = absmax.repeat_interleave(block)[:n].double()
        if spec.startswith("int4"):
            bound = a / 14
        else:
            bound = torch.maximum(a / 24, x.abs().double() / 4)
        err = (x.double() - y.double()).abs()
        worst = max(worst, float((err / (bound * (1 + 1e-6) + 1e-30)).max()))
        energy.append(float(err.square().sum() / x.double().square().sum()))
    assert worst <= 1.0
    # The mean share of the energy lost: far under the bound's worst case, as round-to-nearest gives.
    assert sum(energy) / len(energy) < (0.02 if block <= 64 else 0.04), sum(energy) / len(energy)


def test_fp4_represents_the_e2m1_grid_exactly() -> None:
    grid = torch.cat([E2M1, -E2M1[1:]]) / 6.0 * 3.0  # absmax 3: every code's value times 1/2
    x = torch.cat([grid, torch.zeros(256 - grid.numel())])
    _, y = _roundtrip("fp4", x)
    assert torch.equal(y, x)


def test_4bit_ratios_at_the_default_block() -> None:
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    for spec in ("int4", "fp4"):
        assert x.numel() * 4 / len(get_codec(spec).encode(x)) >= 7.75
    assert (
        get_codec("int4").name == "int4" and Int4Codec(64).name == "int4:64" and FP4Codec(256).name == "fp4"
    )


def test_sparseloco_error_is_its_stated_identity_over_100_draws() -> None:
    codec = SparseLoCoCodec(64)
    for x in _draws(n=2 * CHUNK + 1000):
        _, y = _roundtrip("sparseloco", x)
        lost = 0.0
        for start, length, kept in codec.chunks(x.numel()):
            chunk = x[start : start + length].double()
            mags = chunk.abs().sort(descending=True).values[:kept]
            hi = math.ceil(kept / 2)
            c_hi, c_lo = mags[:hi].mean(), (mags[hi:].mean() if kept > hi else torch.tensor(0.0))
            lost += float(chunk.square().sum() - hi * c_hi**2 - (kept - hi) * c_lo**2)
            got = y[start : start + length]
            assert int((got != 0).sum()) == kept  # the k largest of the chunk, nothing else
            assert bool((chunk.abs()[got != 0] >= mags[-1] * (1 - 1e-6)).all())
            assert bool((torch.sign(got[got != 0]) == torch.sign(chunk[got != 0])).all())
        torch.testing.assert_close(
            float((x.double() - y.double()).square().sum()), lost, rtol=1e-4, atol=1e-6
        )
        assert lost < float(x.double().square().sum())  # a contraction


def _index_bits(payload: bytes, chunks: int, kept: int) -> int:
    """Bits of a sparseloco payload's index section: what follows the codec byte, the 6-byte
    header, the chunk scales and the 2-bit codes."""
    return 8 * (len(payload) - 1 - 6 - 8 * chunks - math.ceil(chunks * kept * 2 / 8))


def test_sparseloco_sizes_and_ratio() -> None:
    x = torch.randn(64 * CHUNK, generator=torch.Generator().manual_seed(1))
    payload, y = _roundtrip("sparseloco", x)
    # The offsets' gaps as the encoder sees them, Rice-coded at the best parameter.
    offsets = torch.nonzero(y.reshape(64, CHUNK))[:, 1].reshape(64, 64)
    gaps = (torch.diff(offsets, dim=1, prepend=torch.full((64, 1), -1)) - 1).reshape(-1).numpy()
    r, bits = rice_param(gaps.astype(np.uint64))
    assert 4 <= r <= 6
    assert _index_bits(payload, 64, 64) == 8 * (
        1 + math.ceil(64 * 64 * r / 8) + math.ceil((bits - 64 * 64 * r) / 8)
    )
    # Within 6% of the entropy of 64 uniform positions of 4096 (log2 C(4096, 64) bits a chunk),
    # against the 12 bits an offset costs at fixed width.
    entropy = (math.lgamma(CHUNK + 1) - math.lgamma(65) - math.lgamma(CHUNK - 63)) / math.log(2)
    assert _index_bits(payload, 64, 64) / 64 <= 1.06 * entropy
    assert x.numel() * 4 / len(payload) >= 180
    small = torch.randn(100, generator=torch.Generator().manual_seed(4))  # one short chunk keeps min(K, 100)
    assert SparseLoCoCodec().chunks(100) == [(0, 100, 64)]
    assert SparseLoCoCodec().chunks(CHUNK + 10) == [(0, CHUNK, 64), (CHUNK, 10, 10)]
    assert int((_roundtrip("sparseloco", small)[1] != 0).sum()) == 64
    # A chunk that keeps all its entries sends no indices: codes and scales only, and r = 0.
    tiny = torch.randn(50, generator=torch.Generator().manual_seed(5))
    payload, y = _roundtrip("sparseloco", tiny)
    assert len(payload) == 1 + 6 + 8 + math.ceil(50 * 2 / 8) + 1
    assert int((y != 0).sum()) == 50
    # demo keeps its rule on padded coefficients: K scaled by the short chunk's length
    assert get_codec("demo").chunks(128) == [(0, 128, 2)]
    assert int((_roundtrip("sparseloco:8", x)[1] != 0).sum()) == 8 * 64


def _crafted(codec: SparseLoCoCodec, n: int, gaps: np.ndarray, rice: bytes | None = None) -> bytearray:
    """A sparseloco payload for an ``n``-element tensor with unit scales, all-positive codes and
    the given index gaps (or the given index section)."""
    chunks = codec.chunks(n)
    total = sum(kept for _, _, kept in chunks)
    body = codec.k.to_bytes(2, "little") + CHUNK.to_bytes(4, "little")
    body += np.ones(2 * len(chunks), dtype="<f4").tobytes() + pack_uint(np.zeros(total, dtype=np.uint64), 2)
    return bytearray(bytes([MODE_CODED]) + body + (rice if rice is not None else rice_encode(gaps)))


def test_sparseloco_payload_checks() -> None:
    x = torch.randn(CHUNK + 10, generator=torch.Generator().manual_seed(2))
    codec = get_codec("sparseloco")
    assert isinstance(codec, SparseLoCoCodec)
    payload = bytearray(codec.encode(x))
    assert payload[0] == MODE_CODED  # the mode byte that _crafted writes
    shape = (CHUNK + 10,)
    with pytest.raises(InvalidUpdateError, match=r"header kept per chunk is 65, the codec spec"):
        bad = bytearray(payload)
        bad[1:3] = (65).to_bytes(2, "little")
        codec.decode(bad, dtype=torch.float32, shape=shape)
    with pytest.raises(InvalidUpdateError, match="truncated"):
        codec.decode(payload[:-3], dtype=torch.float32, shape=shape)
    with pytest.raises(InvalidUpdateError, match="1 trailing bytes after the last unary code"):
        codec.decode(payload + b"\x00", dtype=torch.float32, shape=shape)
    with pytest.raises(InvalidUpdateError, match=r"over the \d+ a torch.float32 \[4106\] tensor allows"):
        codec.decode(payload + bytes(2000), dtype=torch.float32, shape=shape)
    # Crafted index sections: the first chunk's 64 gaps (the 10-element tail keeps all its entries).
    ok = np.full(64, 10, dtype=np.uint64)
    torch.testing.assert_close(
        torch.nonzero(codec.decode(_crafted(codec, CHUNK + 10, ok), dtype=torch.float32, shape=shape))[:, 0],
        torch.cat([torch.arange(10, 64 * 11, 11), torch.arange(CHUNK, CHUNK + 10)]),
    )
    with pytest.raises(InvalidUpdateError, match="past the end of its chunk"):
        codec.decode(
            _crafted(codec, CHUNK + 10, np.full(64, 70, dtype=np.uint64)), dtype=torch.float32, shape=shape
        )
    with pytest.raises(InvalidUpdateError, match="a gap is over 4095"):
        over = np.concatenate([[5000], np.zeros(63)]).astype(np.uint64)
        codec.decode(_crafted(codec, CHUNK + 10, over), dtype=torch.float32, shape=shape)
    with pytest.raises(InvalidUpdateError, match="rice parameter 13 is over the 12 bits"):
        codec.decode(
            _crafted(codec, CHUNK + 10, ok, rice=bytes([13]) + bytes(20)), dtype=torch.float32, shape=shape
        )
    with pytest.raises(InvalidUpdateError, match="truncated indices: 42 unary codes, 64 expected"):
        # gaps of 10 at r = 2 (tied with 3, the smaller wins): "110" each; 16 bytes hold 42 codes
        cut = rice_encode(ok)[:-8]
        codec.decode(_crafted(codec, CHUNK + 10, ok, rice=cut), dtype=torch.float32, shape=shape)
    longer = ok.copy()
    longer[0] = 40  # r = 4: unary "110" then 63 "0", 66 bits: 6 padding bits
    assert rice_param(longer) == (4, 64 * 4 + 66)
    padded = bytearray(_crafted(codec, CHUNK + 10, longer))
    codec.decode(padded, dtype=torch.float32, shape=shape)
    padded[-1] |= 0x80  # a 1 among the padding bits after the last unary code
    with pytest.raises(InvalidUpdateError, match="padding bits are not zero"):
        codec.decode(padded, dtype=torch.float32, shape=shape)
