"""4-bit block quantizers for outer gradients: ``int4[:BLOCK]`` and ``fp4[:BLOCK]`` (e2m1).

Both send 4 bits per element plus one float32 scale per block of ``BLOCK`` elements
(default 256, the last block may be shorter): 4.125 bits per element at the default, 7.76x
fewer bytes than float32 (the 4-bit outer gradients of streaming DiLoCo, Douillard et al. 2025).
Rounding is to nearest and deterministic, so every receiver rebuilds identical bits; both are
contractive and meant to run under error feedback (the uplink's). Error bounds, per element
``x`` of a block with absmax ``a``, before the final cast to the declared dtype:

- ``int4``: ``q = round(7 x / a)`` in ``-7..7``; ``|x - x^| <= a / 14``.
- ``fp4``: ``x / s`` with ``s = a / 6`` rounded to the nearest e2m1 value
  (``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and their negatives); ``|x - x^| <= max(a / 24, |x| / 4)``:
  a relative error at most 1/4 for every element above ``a / 24``, which keeps the small
  entries of a block that int4 zeroes.

Body: u32 block size, float32 scale per block (``a``; the absmax), then the codes packed two
to a byte, the first in the low nibble. ``int4`` codes are ``q + 8`` (1..15; 0 is refused);
``fp4`` codes are a sign bit (8) over the index of the e2m1 magnitude.
"""

from __future__ import annotations

import functools
import math

import torch

from fedgrid.compression._payload import (
    Reader,
    check_scales,
    f32_bytes,
    numel,
    scaled_slabs,
    unpack_codes,
)
from fedgrid.compression.base import FloatCodec

__all__ = ["Int4Codec", "FP4Codec", "E2M1", "DEFAULT_BLOCK_4BIT"]

#: Elements per scale of ``int4`` and ``fp4`` when the spec names none.
DEFAULT_BLOCK_4BIT = 256
#: The e2m1 magnitudes (FP4 of the OCP microscaling formats): 1 sign, 2 exponent, 1 mantissa bit.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1_MIDPOINTS = (E2M1[1:] + E2M1[:-1]) / 2
_KEY_ROUND = (1 << 21) - 1


@functools.lru_cache(maxsize=4)
def _fp4_table(device: torch.device) -> torch.Tensor:
    """fp4 code (uint8) of the float32 ``v = unit * 6`` (``|v| < 6.000001``), indexed by
    ``ceil(bits(v) / 2**21)`` mod 2**11: the e2m1 index, plus 8 for a negative ``v`` (not -0.0)."""
    key = torch.arange(1024)
    index = (key[:, None] > (_E2M1_MIDPOINTS.view(torch.int32) >> 21)[None, :]).sum(dim=1)
    negative = index + 8
    negative[0] = 0  # -0.0 is not below zero
    return torch.cat([index, negative]).to(torch.uint8).to(device)


class _Block4(FloatCodec):
    """The shared block format; subclasses map ``x / absmax`` (in ``[-1, 1]``) to codes and back."""

    family = ""
    checks_finite = True

    def __init__(self, block: int = DEFAULT_BLOCK_4BIT) -> None:
        if not 8 <= block <= 65536:
            raise ValueError(f"{self.family} block size must be in 8..65536, got {block}")
        self.block = block
        self.name = self.family if block == DEFAULT_BLOCK_4BIT else f"{self.family}:{block}"

    def _to_codes(self, unit: torch.Tensor, out: torch.Tensor) -> None:
        """Writes into uint8 ``out`` the codes of ``unit`` (``x / absmax``, clamped to [-1, 1]; a
        scratch buffer the hook may modify)."""
        raise NotImplementedError

    def _from_codes(self, codes: torch.Tensor, reader: Reader) -> torch.Tensor:
        raise NotImplementedError

    def _max_body(self, shape: tuple[int, ...], dtype: torch.dtype) -> int | None:
        n = numel(shape)
        return 4 + 4 * math.ceil(n / self.block) + math.ceil(n / 2)

    def _encode_body(
        self, x: torch.Tensor, *, generator: torch.Generator | None, key: str | None
    ) -> list[bytes | memoryview]:
        n = x.numel()
        absmax, slabs = scaled_slabs(x, self.block, 1.0, self.name)
        packed = torch.empty((n + 1) // 2, dtype=torch.uint8, device=x.device)
        codes = pairs = None
        for start, unit in slabs:  # a cache-sized slab at a time; slabs are of an even length
            if codes is None or pairs is None:
                codes = torch.empty(unit.numel() + 2, dtype=torch.uint8, device=x.device)
                pairs = torch.empty(unit.numel() // 2 + 1, dtype=torch.int16, device=x.device)
            valid = min(unit.numel(), n - start)  # the last block's padding is not sent
            # |x| <= absmax makes |unit| at most 1 + 2**-23: both codes round it to the largest
            # magnitude (7, 6.0), so no clamp to [-1, 1] is needed.
            self._to_codes(unit.reshape(-1), codes[: unit.numel()])
            if valid % 2:
                codes[valid] = 0  # an odd count's last byte: the high nibble is zero
            # Two codes as a little-endian int16 v = c0 + 256 c1 (each < 16): the low byte of
            # v | v >> 4 is c0 | c1 << 4, the packed byte (pack_codes' order).
            both = codes[: valid + valid % 2].view(torch.int16)
            out = torch.bitwise_right_shift(both, 4, out=pairs[: both.numel()]).bitwise_or_(both)
            packed[start // 2 : start // 2 + both.numel()].copy_(out)
        return [self.block.to_bytes(4, "little"), f32_bytes(absmax), packed.cpu().numpy().data]

    def _decode_body(self, reader: Reader, *, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = numel(shape)
        nblocks = math.ceil(n / self.block)
        reader.expect(4, self.block, "block size")
        absmax = check_scales(reader, reader.array("<f4", nblocks, "block scales"), "block scales")
        codes = unpack_codes(reader, n, 4)
        reader.finish()
        unit = self._from_codes(codes, reader)
        pad = nblocks * self.block - n
        values = torch.nn.functional.pad(unit, (0, pad)).reshape(nblocks, self.block) * absmax[:, None]
        return values.reshape(-1)[:n]


class Int4Codec(_Block4):
    """``int4[:BLOCK]``: symmetric 4-bit integer codes, ``round(7 x / absmax)``, one float32 absmax per block."""

    family = "int4"

    def _to_codes(self, unit: torch.Tensor, out: torch.Tensor) -> None:
        # Codes 1..15 as int8 are the same bytes; torch's float-to-int8 copy is 10x its float-to-uint8.
        out.view(torch.int8).copy_(unit.mul_(7.0).round_().add_(8))

    def _from_codes(self, codes: torch.Tensor, reader: Reader) -> torch.Tensor:
        if bool((codes == 0).any()):
            raise reader.fail("code 0 is outside 1..15 (-7..7 offset by 8)")
        return (codes - 8).float() / 7.0


class FP4Codec(_Block4):
    """``fp4[:BLOCK]``: e2m1 codes of ``x / (absmax / 6)``, rounded to nearest, one float32 absmax per block."""

    family = "fp4"

    def _to_codes(self, unit: torch.Tensor, out: torch.Tensor) -> None:
        # Rounding to nearest e2m1 value, ties down, of s = |unit| * 6, is the count of midpoints
        # below s (bucketize's). Every midpoint's float32 bits are a multiple of 2**21, so that
        # count depends only on ceil(bits(s) / 2**21): one table lookup on 11 bits, the sign bit
        # included (bucketize and its where ran at 0.04 GB/s).
        bits = unit.mul_(6.0).view(torch.int32)
        key = bits.add_(_KEY_ROUND).bitwise_right_shift_(21).bitwise_and_(0x7FF)
        torch.index_select(_fp4_table(unit.device), 0, key, out=out)

    def _from_codes(self, codes: torch.Tensor, reader: Reader) -> torch.Tensor:
        magnitude = E2M1[codes & 7] / 6.0
        return torch.where(codes >= 8, -magnitude, magnitude)
