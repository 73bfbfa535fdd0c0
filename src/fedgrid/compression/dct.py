"""``demo[:K]``: top-k in the DCT domain with 2-bit values, DeMo's outer-gradient codec.

DeMo (Peng et al. 2024) sends the largest coefficients of a chunked DCT-II of its momentum
and keeps the rest as local momentum (error feedback with decay: run it under
``error_feedback = "momentum:BETA"``). Here the flat tensor is cut into the same 4096-element
chunks as ``sparseloco``; each chunk is read as a 64 x 64 block (row-major) and transformed
by the separable orthonormal 2-D DCT-II ``C = D X D^T`` (``D`` the 64-point DCT-II matrix,
built once per size; torch has no DCT). A shorter last chunk of ``L`` elements is padded
with zeros to ``r = ceil(L / 64)`` rows and transformed by the ``r``-point and 64-point
matrices. The coefficients then travel exactly as ``sparseloco[:K]`` sends values (its
kept-per-chunk rule on the padded lengths, Rice-coded offsets, sign and larger/smaller half,
two float32 means per chunk), so at the same ``K`` both codecs cost the same bytes up to
the last chunk's padding; the receiver decodes the coefficients and applies ``D^T C D``.

Error bound: the transform is orthonormal, so ``||x - x^||^2 <= ||c - c^||^2`` (equality
without padding), and ``||c - c^||^2`` is ``sparseloco``'s exact per-chunk bound on the
coefficients ``c``: contractive. It pays where a chunk's energy concentrates in few
frequencies (smooth rows); an outer gradient of AdamW steps is close to white, and then it
keeps no more energy than ``sparseloco`` (measured in benchmarks/README.md).

Under FedAvg and its server optimizers ``demo`` goes as ``demo:K:scaled`` (``form_under``), and
a bare ``demo`` keeps ``FEDAVG_K`` = 320 coefficients per chunk there (7.8%), not DeMo's 64: an
MLP's weights have no smooth rows for the DCT to concentrate. On digits (5 rounds, seeds 5-9,
``none`` 0.859 on average) ``demo:64:scaled`` ends 0.21 below ``none`` at seed 5, ``demo:128``
0.087 below on average, ``demo:256`` 0.017 (0.045 at its worst seed), ``demo:320`` 0.004 (0.028
at its worst; benchmarks/README.md). A spec that names ``K`` keeps it.

Body: ``sparseloco``'s body for the padded coefficient vector.
"""

from __future__ import annotations

import math
from functools import lru_cache
from types import MappingProxyType
from typing import Any, Mapping

import torch

from fedgrid.compression._payload import Reader, numel
from fedgrid.compression.sparseloco import CHUNK, DEFAULT_K, SparseLoCoCodec
from fedgrid.types import UpdateRole

__all__ = ["DCTTopKCodec", "ScaledDCTTopKCodec", "SIDE", "FEDAVG_K", "dct_matrix"]

#: Side of a chunk's square block: CHUNK = SIDE * SIDE.
SIDE = math.isqrt(CHUNK)
#: Coefficients per chunk of a bare ``demo`` under model averaging (its ``:scaled`` form there):
#: the smallest multiple of 64 within 0.03 of ``none`` at each digits seed 5-9 (module docstring).
FEDAVG_K = 320
#: Chunks ``transform`` multiplies at a time (2 MiB of float32).
_SLAB_CHUNKS = 128


@lru_cache(maxsize=None)
def dct_matrix(size: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``D`` of ``size`` points (``D @ D.T`` is the identity), float64.

    ``D[f, t] = s_f cos(pi (t + 1/2) f / size)`` with ``s_0 = sqrt(1/size)``, ``s_f = sqrt(2/size)``.
    """
    if size < 1:
        raise ValueError(f"a DCT needs at least 1 point, got {size}")
    t = torch.arange(size, dtype=torch.float64)
    d = torch.cos(math.pi * (t[None, :] + 0.5) * t[:, None] / size) * math.sqrt(2.0 / size)
    d[0] /= math.sqrt(2.0)
    return d


def _matrix(size: int, dtype: torch.dtype) -> torch.Tensor:
    return dct_matrix(size).to(dtype)


class DCTTopKCodec(SparseLoCoCodec):
    """``demo[:K]``: per 4096-element chunk (a 64 x 64 block), the ``K`` largest 2-D DCT-II
    coefficients as sign and 1-bit magnitude.

    Args:
        k: coefficients kept per full chunk, 1..4096.
        named: the spec named ``k`` (``demo:K``); a bare ``demo`` keeps ``FEDAVG_K`` under
            model averaging (``form_under``). Default: ``k`` differs from ``DEFAULT_K``.
    """

    #: DeMo's own settings, measured with DiLoCo's outer step and classic auto feedback
    #: (benchmarks/README.md): not ``sparseloco``'s outer step, aggregator or short-chunk rule.
    auto_feedback = "classic"
    auto_strategy: Mapping[UpdateRole, Mapping[str, Any]] = MappingProxyType({})
    short_keeps_k = False

    family = "demo"
    fedavg_k = FEDAVG_K

    def __init__(self, k: int = DEFAULT_K, *, named: bool | None = None) -> None:
        if not 1 <= k <= CHUNK:
            raise ValueError(f"demo keeps 1..{CHUNK} coefficients per chunk, got {k}")
        super().__init__(k, named=named)

    @staticmethod
    def padded(n: int) -> int:
        """Length of the coefficient vector of an ``n``-element tensor (the last chunk padded to 64s)."""
        full, tail = divmod(n, CHUNK)
        return full * CHUNK + SIDE * math.ceil(tail / SIDE)

    def transform(self, flat: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
        """The chunked 2-D DCT-II of ``flat`` (float32; ``padded(n)`` coefficients), or with
        ``inverse`` the values (``padded(n)`` of them; the caller keeps the first ``n``)."""
        n = flat.numel()
        m = n if inverse else self.padded(n)
        x = flat.reshape(-1).float()
        if m > n:
            x = torch.cat([x, x.new_zeros(m - n)])
        full = m // CHUNK
        out = torch.empty(m, dtype=x.dtype, device=x.device)
        d = _matrix(SIDE, x.dtype).to(x.device)
        # A slab of chunks at a time into one output and one scratch buffer (the products of
        # a whole tensor were two fresh tensor-sized buffers, faulted in page by page).
        step = full if x.device.type != "cpu" else _SLAB_CHUNKS
        scratch = torch.empty(min(step, full), SIDE, SIDE, dtype=x.dtype, device=x.device)
        for i in range(0, full, step):
            blocks = x[i * CHUNK : min(i + step, full) * CHUNK].view(-1, SIDE, SIDE)
            count = blocks.shape[0]
            self._apply(
                blocks,
                d,
                d,
                inverse,
                out[i * CHUNK : (i + count) * CHUNK].view(count, SIDE, SIDE),
                scratch[:count],
            )
        if m % CHUNK:
            tail = x[full * CHUNK :].reshape(1, -1, SIDE)
            out[full * CHUNK :] = self._apply(
                tail, _matrix(tail.shape[1], x.dtype).to(x.device), d, inverse
            ).reshape(-1)
        return out

    @staticmethod
    def _apply(
        blocks: torch.Tensor,
        rows: torch.Tensor,
        cols: torch.Tensor,
        inverse: bool,
        out: torch.Tensor | None = None,
        scratch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        left, right = (rows.T, cols) if inverse else (rows, cols.T)
        if out is None or scratch is None:
            return left @ blocks @ right
        return torch.matmul(torch.matmul(left, blocks, out=scratch), right, out=out)

    def _max_body(self, shape: tuple[int, ...], dtype: torch.dtype) -> int | None:
        return super()._max_body((self.padded(numel(shape)),), dtype)

    def _encode_body(
        self, x: torch.Tensor, *, generator: torch.Generator | None, key: str | None
    ) -> list[bytes]:
        return super()._encode_body(self.transform(x), generator=generator, key=key)

    def _decode_body(self, reader: Reader, *, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = numel(shape)
        coefficients = super()._decode_body(reader, shape=(self.padded(n),), dtype=dtype)
        return self.transform(coefficients, inverse=True)[:n]


class ScaledDCTTopKCodec(DCTTopKCodec):
    """``demo:K:scaled``: ``demo``'s wire format, each chunk's two magnitudes multiplied by
    ``||c||^2 / ||c^||^2`` of its coefficients, as ``sparseloco:K:scaled`` does; the DCT is
    orthonormal, so the decoded chunk moves as far along ``x`` as ``x`` itself. Not contractive:
    it runs without error feedback. ``demo``'s form under FedAvg (``form_under``)."""

    scaled = True
    short_keeps_k = True
    contractive = False
    auto_feedback = "none"

    def __init__(self, k: int = DEFAULT_K) -> None:
        super().__init__(k, named=True)
        self.name = f"demo:{k}:scaled"
