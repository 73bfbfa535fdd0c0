"""The outer-gradient codecs: int4 and fp4 (4 bits, per-block absmax) and sparseloco (top-k per
chunk, 2-bit values): their stated bounds, checked over many draws, their sizes and their payload checks."""

from __future__ import annotations

import math

import pytest
import torch

from fedgrid.compression import FP4Codec, Int4Codec, SparseLoCoCodec, get_codec
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


def test_sparseloco_sizes_and_ratio() -> None:
    x = torch.randn(64 * CHUNK, generator=torch.Generator().manual_seed(1))
    payload, _ = _roundtrip("sparseloco", x)
    per_chunk = 64 * (12 + 2) / 8 + 8
    assert len(payload) == 1 + 6 + 64 * per_chunk
    assert x.numel() * 4 / len(payload) >= 136
    small = torch.randn(100, generator=torch.Generator().manual_seed(4))  # one short chunk keeps min(K, 100)
    assert SparseLoCoCodec().chunks(100) == [(0, 100, 64)]
    assert SparseLoCoCodec().chunks(CHUNK + 10) == [(0, CHUNK, 64), (CHUNK, 10, 10)]
    assert int((_roundtrip("sparseloco", small)[1] != 0).sum()) == 64
    # demo keeps its rule on padded coefficients: K scaled by the short chunk's length
    assert get_codec("demo").chunks(128) == [(0, 128, 2)]
    assert int((_roundtrip("sparseloco:8", x)[1] != 0).sum()) == 8 * 64


def test_sparseloco_payload_checks() -> None:
    x = torch.randn(CHUNK + 10, generator=torch.Generator().manual_seed(2))
    codec = get_codec("sparseloco")
    payload = bytearray(codec.encode(x))
    shape = (CHUNK + 10,)
    with pytest.raises(InvalidUpdateError, match=r"header kept per chunk is 65, the codec spec"):
        bad = bytearray(payload)
        bad[1:3] = (65).to_bytes(2, "little")
        codec.decode(bad, dtype=torch.float32, shape=shape)
    indices_at = 1 + 6 + 8 * 2
    swapped = bytearray(payload)
    swapped[indices_at : indices_at + 3] = b"\xff\xff\xff"  # the first two offsets: 4095 and 4095
    with pytest.raises(InvalidUpdateError, match="not strictly increasing within a chunk"):
        codec.decode(swapped, dtype=torch.float32, shape=shape)
    with pytest.raises(InvalidUpdateError, match="truncated"):
        codec.decode(payload[:-3], dtype=torch.float32, shape=shape)
    with pytest.raises(InvalidUpdateError, match=r"over the \d+ a torch.float32 \[4106\] tensor allows"):
        codec.decode(payload + b"\x00", dtype=torch.float32, shape=shape)
    short = torch.randn(300)  # one chunk of 300: 64 kept, 12-bit offsets that must stay under 300
    payload = bytearray(codec.encode(short))
    payload[1 + 6 + 8 : 1 + 6 + 8 + 2] = b"\xff\x0f"  # first offset 4095
    with pytest.raises(InvalidUpdateError, match="past the end of its chunk"):
        codec.decode(payload, dtype=torch.float32, shape=(300,))
