"""Dense quantizers: ``fp16``, ``bf16``, ``int8`` (per-block absmax), ``qsgd:LEVELS``, ``sign``.

Each states its error bound (per element ``i`` of a tensor ``x``, before the final cast to
the declared dtype, which adds that dtype's own rounding):

- ``fp16`` / ``bf16``: ``x`` rounded to half precision, relative error at most 2**-11 / 2**-8
  in the normal range (absolute 2**-25 below it for fp16). Values fp16 cannot hold
  (beyond 65504) make the whole tensor fall back to its raw bytes.
- ``int8[:BLOCK]``: per block of ``BLOCK`` (default 256) elements, ``q = round(127 x / a)``
  with ``a`` the block's absmax; ``|x - x^| <= a / 254``. 1 byte per element plus 4 per block.
- ``qsgd:LEVELS`` (Alistarh et al., 2017): per bucket of 512 elements with L2 norm ``r``,
  ``x^ = r sign(x) l / s`` with ``l`` in ``0..s`` drawn so that ``E[x^] = x`` (unbiased);
  ``|x - x^| < r / s``. Codes take 2, 4, 8 or 16 bits (sign and level), so ``s <= 32767``.
  Its variance factor is ``w = min(512 / s**2, sqrt(512) / s)``; only ``s >= 23`` makes
  ``w < 1``, the contraction error feedback needs, so fewer levels are for plain use.
- ``sign[:BLOCK]``: scaled sign (EF-signSGD, Karimireddy et al. 2019) in a rotated basis: each
  block ``b`` of ``BLOCK`` (256) elements, zero-padded, is rotated, ``r = H D b`` (``D`` fixed
  random signs, ``H`` the orthonormal Walsh-Hadamard transform), sent as
  ``r^ = mean|r| * sign(r)`` (zero counts as positive) and rotated back, ``b^ = D H r^``.
  1 bit per element plus a float32 scale per block (1.125 bits, 28.4x fewer than float32).
  Per block ``||b - b^||^2 <= ||b||^2 - ||r||_1^2 / BLOCK`` (equal for a whole block), a
  contraction made for error feedback. The rotation is what makes it learn: a model update's
  heavy tails and exact zeros make ``||x||_1^2 / (n ||x||^2)`` small (0.23 on the digits MLP),
  so unrotated sign sent a quarter of the update's energy per round; rotated blocks are near
  Gaussian, where that share is ``2 / pi``.

Decoding is elementwise in a fixed order, so every receiver rebuilds identical bits.
"""

from __future__ import annotations

import functools
import hashlib
import math

import numpy as np
import torch

from fedgrid.compression._payload import (
    Reader,
    as_blocks,
    check_scales,
    f32_bytes,
    numel,
    pack_bits,
    pack_codes,
    scaled_slabs,
    unpack_bits,
    unpack_codes,
)
from fedgrid.compression.base import FloatCodec, all_finite

__all__ = ["CastCodec", "Int8Codec", "QSGDCodec", "SignCodec", "QSGD_BUCKET", "SIGN_BLOCK", "hadamard"]

#: Elements per QSGD bucket (one float32 norm each).
QSGD_BUCKET = 512
#: The rotation block of ``sign`` when the spec names none.
SIGN_BLOCK = 256


class CastCodec(FloatCodec):
    """``fp16`` / ``bf16``: each element rounded to a 16-bit float.

    Args:
        target: ``torch.float16`` or ``torch.bfloat16``.
    """

    data_fallback = True

    def __init__(self, target: torch.dtype) -> None:
        if target not in (torch.float16, torch.bfloat16):
            raise ValueError(f"CastCodec needs float16 or bfloat16, got {target}")
        self.target = target
        self.name = "fp16" if target is torch.float16 else "bf16"

    def _max_body(self, shape: tuple[int, ...], dtype: torch.dtype) -> int | None:
        return 2 * numel(shape)

    def _encode_body(
        self, x: torch.Tensor, *, generator: torch.Generator | None, key: str | None
    ) -> list[bytes] | None:
        y = x.reshape(-1).to(self.target)
        if not all_finite(y):
            return None  # out of the target's range: send the exact bytes instead
        return [y.to("cpu").view(torch.int16).numpy().tobytes()]

    def _decode_body(self, reader: Reader, *, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = numel(shape)
        values = torch.from_numpy(reader.array("<i2", n, "values")).view(self.target)
        reader.finish()
        if not bool(torch.isfinite(values).all()):
            raise reader.fail("values hold NaN or Inf")
        return values


class Int8Codec(FloatCodec):
    """``int8[:BLOCK]``: symmetric 8-bit codes with one float32 absmax per block.

    Body: u32 block size, float32 absmax per block, int8 code per element (in -127..127).

    Args:
        block: elements per scale, 8..65536.
    """

    checks_finite = True

    def __init__(self, block: int = 256) -> None:
        if not 8 <= block <= 65536:
            raise ValueError(f"int8 block size must be in 8..65536, got {block}")
        self.block = block
        self.name = "int8" if block == 256 else f"int8:{block}"

    def _max_body(self, shape: tuple[int, ...], dtype: torch.dtype) -> int | None:
        n = numel(shape)
        return 4 + 4 * math.ceil(n / self.block) + n

    def _encode_body(
        self, x: torch.Tensor, *, generator: torch.Generator | None, key: str | None
    ) -> list[bytes | memoryview]:
        n = x.numel()
        absmax, slabs = scaled_slabs(x, self.block, 127.0, self.name)
        codes = torch.empty(absmax.numel() * self.block, dtype=torch.int8, device=x.device)
        # round(127 x / absmax), a cache-sized slab at a time; |x| <= absmax, so the product is
        # under 127 (1 + 2**-23)**2 and rounds into -127..127 with no clamp.
        for start, scaled in slabs:
            codes[start : start + scaled.numel()].copy_(scaled.round_().reshape(-1))
        return [self.block.to_bytes(4, "little"), f32_bytes(absmax), codes[:n].cpu().numpy().data]

    def _decode_body(self, reader: Reader, *, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = numel(shape)
        nblocks = math.ceil(n / self.block)
        reader.expect(4, self.block, "block size")
        absmax = check_scales(reader, reader.array("<f4", nblocks, "block scales"), "block scales")
        codes = torch.from_numpy(reader.array("i1", n, "codes"))
        reader.finish()
        if bool((codes == -128).any()):
            raise reader.fail("code -128 is outside -127..127")
        step = absmax / 127.0
        pad = nblocks * self.block - n
        values = torch.nn.functional.pad(codes.float(), (0, pad)).reshape(nblocks, self.block) * step[:, None]
        return values.reshape(-1)[:n]


def _code_bits(levels: int) -> int:
    """Bits per QSGD code: the smallest of 2, 4, 8, 16 that holds the 2 * levels + 1 values."""
    for bits in (2, 4, 8, 16):
        if 2 * levels + 1 <= 1 << bits:
            return bits
    raise ValueError(f"qsgd supports at most 32767 levels, got {levels}")


class QSGDCodec(FloatCodec):
    """``qsgd:LEVELS``: stochastic, unbiased quantization to ``LEVELS`` levels per sign.

    Body: u16 levels, u32 bucket size, float32 L2 norm per bucket, packed codes
    (``sign * level + LEVELS``, in ``0..2 * LEVELS``).

    Args:
        levels: quantization levels ``s`` per sign, 1..32767.
    """

    stochastic = True

    def __init__(self, levels: int) -> None:
        self.bits = _code_bits(levels)
        if levels < 1:
            raise ValueError(f"qsgd needs at least 1 level, got {levels}")
        self.levels = levels
        self.name = f"qsgd:{levels}"
        #: The variance factor ``w`` of Alistarh et al.: ``E||x^ - x||^2 <= w ||x||^2`` per bucket.
        self.variance = min(QSGD_BUCKET / levels**2, math.sqrt(QSGD_BUCKET) / levels)
        self.contractive = self.variance < 1.0
        if not self.contractive:  # unbiased with a variance too large for a residual: ``auto`` runs none
            self.unbiased, self.auto_feedback = True, "none"

    def _max_body(self, shape: tuple[int, ...], dtype: torch.dtype) -> int | None:
        n = numel(shape)
        return 6 + 4 * math.ceil(n / QSGD_BUCKET) + math.ceil(n * self.bits / 8)

    def _encode_body(
        self, x: torch.Tensor, *, generator: torch.Generator | None, key: str | None
    ) -> list[bytes]:
        n, s = x.numel(), self.levels
        blocks = as_blocks(x, QSGD_BUCKET)
        norms = torch.linalg.vector_norm(blocks, dim=1)
        inv = torch.where(norms > 0, s / norms, torch.zeros_like(norms))
        scaled = (blocks.abs() * inv[:, None]).reshape(-1)[:n].clamp_(0, s)
        noise = torch.rand(
            n, generator=generator, device=generator.device if generator is not None else "cpu"
        )
        # floor(r + u), u ~ U[0, 1), is floor(r) + 1 with probability frac(r): E = r, unbiased.
        level = scaled.add_(noise.to(x.device)).floor_().clamp_(max=s)
        codes = (torch.where(x.reshape(-1) < 0, -level, level) + s).to(torch.int32)
        header = s.to_bytes(2, "little") + QSGD_BUCKET.to_bytes(4, "little")
        return [header, f32_bytes(norms), pack_codes(codes, self.bits)]

    def _decode_body(self, reader: Reader, *, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n, s = numel(shape), self.levels
        nblocks = math.ceil(n / QSGD_BUCKET)
        reader.expect(2, s, "level count")
        reader.expect(4, QSGD_BUCKET, "bucket size")
        norms = check_scales(reader, reader.array("<f4", nblocks, "bucket norms"), "bucket norms")
        codes = unpack_codes(reader, n, self.bits)
        reader.finish()
        if bool((codes > 2 * s).any()):
            raise reader.fail(f"a code is over {2 * s}, the largest of {s} levels")
        step = norms / s
        pad = nblocks * QSGD_BUCKET - n
        signed = torch.nn.functional.pad((codes - s).float(), (0, pad)).reshape(nblocks, QSGD_BUCKET)
        return (signed * step[:, None]).reshape(-1)[:n]


@functools.lru_cache(maxsize=8)
def _flips(block: int) -> torch.Tensor:
    """The rotation's fixed random signs: the first ``block`` bits of SHA-256 of a fixed text, as +-1.0."""
    digest = b"".join(
        hashlib.sha256(b"fedgrid sign rotation %d" % i).digest() for i in range(-(-block // 256))
    )
    bits = np.unpackbits(np.frombuffer(digest, dtype=np.uint8), bitorder="little")[:block]
    return torch.from_numpy(1.0 - 2.0 * bits.astype(np.float32))


def hadamard(rows: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of each row (length a power of two); its own inverse."""
    m, b = rows.shape
    h = 1
    while h < b:
        pairs = rows.reshape(m, -1, 2, h)
        rows = torch.cat((pairs[:, :, :1] + pairs[:, :, 1:], pairs[:, :, :1] - pairs[:, :, 1:]), dim=2)
        h *= 2
    return rows.reshape(m, b) * (1.0 / math.sqrt(b))


class SignCodec(FloatCodec):
    """``sign[:BLOCK]``: the sign of each element of a randomly rotated block, scaled per block.

    Each block of ``BLOCK`` elements (a power of two, default 256; a tensor of fewer elements
    uses the next power of two at or above its size, at least 8) is multiplied by fixed random
    signs and rotated by the Walsh-Hadamard transform; the rotated values travel as their signs
    and one scale, their mean magnitude. Body: u32 block size, float32 scale per block, the
    sign bits of every (zero-padded) block (1 = negative), first element in the lowest bit.

    Args:
        block: rotation block, a power of two in 8..65536.
    """

    def __init__(self, block: int = SIGN_BLOCK) -> None:
        if not (8 <= block <= 65536 and block & (block - 1) == 0):
            raise ValueError(f"sign block size must be a power of two in 8..65536, got {block}")
        self.block = block
        self.name = "sign" if block == SIGN_BLOCK else f"sign:{block}"

    def block_for(self, n: int) -> int:
        """The rotation block of an ``n``-element tensor (the same on both ends)."""
        return min(self.block, max(8, 1 << max(n - 1, 1).bit_length()))

    def _max_body(self, shape: tuple[int, ...], dtype: torch.dtype) -> int | None:
        n = numel(shape)
        block = self.block_for(n)
        nblocks = math.ceil(n / block)
        return 4 + 4 * nblocks + nblocks * block // 8

    def _encode_body(
        self, x: torch.Tensor, *, generator: torch.Generator | None, key: str | None
    ) -> list[bytes]:
        block = self.block_for(x.numel())
        rotated = hadamard(as_blocks(x, block) * _flips(block).to(x.device))
        scale = rotated.abs().mean(dim=1)
        return [block.to_bytes(4, "little"), f32_bytes(scale), pack_bits((rotated < 0).reshape(-1))]

    def _decode_body(self, reader: Reader, *, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = numel(shape)
        block = self.block_for(n)
        nblocks = math.ceil(n / block)
        reader.expect(4, block, "block size")
        scale = check_scales(reader, reader.array("<f4", nblocks, "scale"), "scale")
        bits = unpack_bits(
            reader.take(nblocks * block // 8, "sign bits"), nblocks * block, reader, "sign bits"
        )
        reader.finish()
        # 1 - 2 * bit is +1 or -1 exactly, so the rotated values are +-scale bit for bit.
        signs = torch.from_numpy(bits).to(torch.float32).mul_(-2.0).add_(1.0).reshape(nblocks, block)
        return (hadamard(signs * scale[:, None]) * _flips(block)).reshape(-1)[:n]
