"""``powersgd:RANK``: a rank-``r`` approximation ``P Q^T`` from one power iteration (Vogels et al., 2019).

A tensor of two or more dimensions is viewed as a matrix ``M`` of shape
``(shape[0], numel / shape[0])`` (a conv kernel ``(out, in, kh, kw)`` becomes
``(out, in * kh * kw)``), as ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``
does. One step: ``P = orth(M Q0)``, ``Q = M^T P``, send ``P`` and ``Q``; the receiver rebuilds
``P Q^T = P P^T M``, the projection of ``M`` on ``span(P)``. So the error is bounded by
``||M - P Q^T||_F <= ||M||_F``, and an ``M`` of rank at most ``r`` comes back exactly (up to
float32 rounding).

Warm start: when ``encode`` gets a ``key``, the codec keeps that tensor's ``Q`` and starts the
next power iteration from it (the hook's ``warm_start``); without a key it starts from a
Gaussian ``Q0`` drawn from ``generator`` or, when none is given, from a generator seeded with
``seed``, so the same input always gives the same payload. Only the sender holds state;
decoding is stateless.

Vectors (``ndim < 2``), and matrices where ``RANK >= min(rows, cols) / 2`` (where low rank
saves too little, the hook's ``min_compression_rate`` idea), go through the lossless raw path.

Body: u16 rank, then ``P`` (rows x r) and ``Q`` (cols x r) as float32. The receiver sums the
``r`` outer products elementwise in a fixed order instead of calling a matmul, so every
machine (any BLAS, CPU or GPU) rebuilds the same bits.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from fedgrid.compression._payload import Reader, numel
from fedgrid.compression.base import FloatCodec

__all__ = ["PowerSGDCodec", "matrix_view"]


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(rows, cols)`` a tensor of ``shape`` is compressed as, or ``None`` for vectors and scalars."""
    if len(shape) < 2 or shape[0] == 0:
        return None
    return shape[0], numel(shape) // shape[0]


class PowerSGDCodec(FloatCodec):
    """``powersgd:RANK``: low-rank factors with warm start.

    Args:
        rank: the approximation rank, 1..65535.
        seed: seed of the initial ``Q0`` when ``encode`` gets no generator.
    """

    def __init__(self, rank: int, *, seed: int = 0) -> None:
        if not 1 <= rank <= 65535:
            raise ValueError(f"powersgd rank must be in 1..65535, got {rank}")
        self.rank = rank
        self.seed = seed
        self.name = f"powersgd:{rank}"
        self._warm: dict[str, torch.Tensor] = {}

    def _max_body(self, shape: tuple[int, ...], dtype: torch.dtype) -> int | None:
        view = matrix_view(shape)
        if view is None or 2 * self.rank >= min(view):
            return None
        rows, cols = view
        return 2 + 4 * self.rank * (rows + cols)

    def _initial_q(self, cols: int, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
        gen = generator if generator is not None else torch.Generator().manual_seed(self.seed)
        return torch.randn(cols, self.rank, generator=gen, device=gen.device).to(device)

    def _encode_body(
        self, x: torch.Tensor, *, generator: torch.Generator | None, key: str | None
    ) -> list[bytes]:
        view = matrix_view(tuple(x.shape))
        assert view is not None  # _max_body sent every other shape down the raw path
        rows, cols = view
        m = x.reshape(rows, cols).float()
        slot = f"{key}@{rows}x{cols}" if key is not None else None
        q0 = self._warm.get(slot) if slot is not None else None
        if q0 is None or not bool((q0.abs().sum(dim=0) > 0).all()):
            q0 = self._initial_q(cols, m.device, generator)  # a zero column would never recover
        p = torch.linalg.qr(m @ q0.to(m.device)).Q
        q = m.T @ p
        if slot is not None:
            self._warm[slot] = q.clone()
        as_bytes = [t.to("cpu").contiguous().numpy().tobytes() for t in (p, q)]
        return [self.rank.to_bytes(2, "little"), *as_bytes]

    def _decode_body(self, reader: Reader, *, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        view = matrix_view(shape)
        assert view is not None
        rows, cols = view
        reader.expect(2, self.rank, "rank")
        p = torch.from_numpy(reader.array("<f4", rows * self.rank, "P")).reshape(rows, self.rank)
        q = torch.from_numpy(reader.array("<f4", cols * self.rank, "Q")).reshape(cols, self.rank)
        reader.finish()
        if not (bool(torch.isfinite(p).all()) and bool(torch.isfinite(q).all())):
            raise reader.fail("factors hold NaN or Inf")
        out = p[:, 0:1] * q[:, 0]
        for j in range(1, self.rank):
            out += p[:, j : j + 1] * q[:, j]
        return out.reshape(-1)

    # -- warm-start state ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"warm_q": {slot: q.to("cpu").clone() for slot, q in self._warm.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._warm = {slot: q.clone() for slot, q in state.get("warm_q", {}).items()}

    def reset(self) -> None:
        """Forgets every warm-start ``Q``."""
        self._warm.clear()
