"""The arithmetic of SecAgg+ (Bell et al. 2020), with no I/O: Shamir sharing over a prime
field, the neighbour graph, fixed-point quantization into the ring Z_(2^bits), and the mask
PRG (AES-256-CTR from a 256-bit seed).

The ring: a client's update becomes integers modulo ``2^bits`` (``bits`` 8, 16 or 32), so a
masked upload weighs what a plain upload of those integers weighs (one byte a coordinate at
8 bits: the cost of the ``int8`` codec). Weights are premultiplied: client ``i`` with weight
``w_i`` of the round's total ``W`` quantizes ``(w_i / W) * clamp(x_i, -clip, clip)`` at
``scale`` steps per unit, with stochastic rounding (unbiased). The sum over any subset of the
round's clients then lies within ``+-(scale * clip + n)`` steps, which ``ring_scale`` keeps
below ``2^(bits-1)``: the masked sum never wraps, and decoding it gives the survivors'
weighted sum of clipped updates divided by ``W``.
"""

from __future__ import annotations

import hashlib
import random
import secrets
from dataclasses import dataclass
from typing import Sequence

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedgrid.errors import FedgridError

__all__ = [
    "PRIME",
    "RING_BITS",
    "SecAggAbortedError",
    "share_secret",
    "combine_shares",
    "neighbours",
    "default_neighbours",
    "neighbours_for",
    "round_failure",
    "ring_scale",
    "ring_dtype",
    "quantize",
    "dequantize",
    "prg",
    "ring_add",
    "to_wire",
    "from_wire",
    "RoundPlan",
    "mask_sign",
]

#: The Shamir field: the Mersenne prime 2^521 - 1, large enough for a 256-bit secret as it is.
PRIME = (1 << 521) - 1
#: Share payload size: an x coordinate (2 bytes) and a field element (66 bytes).
SHARE_BYTES = 2 + 66
#: The ring widths: 8 (masked int8), 16 and 32 bits.
RING_BITS = (8, 16, 32)
_WIRE = {8: torch.uint8, 16: torch.int16, 32: torch.int32}


class SecAggAbortedError(FedgridError):
    """A secure-aggregation round cannot be unmasked (too few survivors or shares): the round
    aborts and no partial sum is returned."""


def share_secret(secret: bytes, *, threshold: int, xs: Sequence[int]) -> dict[int, bytes]:
    """Shamir shares of ``secret`` (at most 64 bytes) at the points ``xs`` (distinct, 1 to
    65535): any ``threshold`` of them give it back, fewer reveal nothing.

    Raises:
        ValueError: a threshold outside 1..len(xs), a repeated or out-of-range point, a secret too long.
    """
    if len(secret) > 64:
        raise ValueError(f"a Shamir secret holds at most 64 bytes, got {len(secret)}")
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold {threshold} must be between 1 and the {len(xs)} shares")
    if len(set(xs)) != len(xs) or not all(0 < x < 65536 for x in xs):
        raise ValueError("share points must be distinct integers in 1..65535")
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    out: dict[int, bytes] = {}
    for x in xs:
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        out[x] = x.to_bytes(2, "big") + y.to_bytes(66, "big")
    return out


def combine_shares(shares: Sequence[bytes], *, threshold: int, size: int = 32) -> bytes:
    """The secret of ``size`` bytes from at least ``threshold`` shares (``share_secret``'s).

    Raises:
        SecAggAbortedError: fewer than ``threshold`` distinct shares.
        ValueError: a malformed share.
    """
    points: dict[int, int] = {}
    for share in shares:
        if len(share) != SHARE_BYTES:
            raise ValueError(f"a share is {SHARE_BYTES} bytes, got {len(share)}")
        x, y = int.from_bytes(share[:2], "big"), int.from_bytes(share[2:], "big")
        if x == 0 or y >= PRIME:
            raise ValueError("a share's point is 0 or its value is outside the field")
        points[x] = y
    if len(points) < threshold:
        raise SecAggAbortedError(f"{len(points)} distinct shares, {threshold} needed")
    chosen = sorted(points.items())[:threshold]
    secret = 0
    for i, (xi, yi) in enumerate(chosen):
        num, den = 1, 1
        for j, (xj, _) in enumerate(chosen):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    if secret >> (8 * size):
        raise ValueError("the shares do not combine to a secret of the expected size")
    return secret.to_bytes(size, "big")


def default_neighbours(n: int) -> int:
    """The neighbourhood size for ``n`` clients: about ``2 log2 n`` (at least 4), even, below
    ``n``; everyone when ``n`` is that small (Bell et al.: O(log n) keeps the round's cost
    O(log n) a client while a dropout rate of 10-30% still leaves each client enough holders)."""
    if n <= 1:
        return 0
    k = max(4, 2 * (n - 1).bit_length())
    k += k % 2
    return min(k, n - 1)


def round_failure(k: int, dropout: float, secrets: int) -> float:
    """The chance that a round rebuilding ``secrets`` secrets, each shared among ``k``
    holders with a majority threshold, aborts when each holder is gone with chance ``dropout``."""
    from math import comb

    t = k // 2 + 1
    alive = 1.0 - dropout
    one = sum(comb(k, i) * alive**i * dropout ** (k - i) for i in range(t))
    return 1.0 - (1.0 - one) ** secrets


def neighbours_for(n: int, dropout: float, *, failure: float = 0.01) -> int:
    """The smallest even k (at least ``default_neighbours(n)``) whose rounds of ``n`` clients
    abort with chance under ``failure`` when ``dropout`` of them drop after sharing; ``n - 1``
    (everyone) if none does."""
    k = default_neighbours(n)
    while k < n - 1 and round_failure(k, dropout, n) >= failure:
        k += 2
    return min(k, n - 1)


def neighbours(ids: Sequence[str], *, k: int, seed: bytes) -> dict[str, list[str]]:
    """The k-regular neighbour graph of ``ids``: a circulant graph (each links to the ``k / 2``
    before and after it) over an order drawn from ``seed``; everyone with everyone when ``k``
    reaches ``len(ids) - 1``. Neighbour lists follow ``ids``' order.

    Raises:
        ValueError: repeated ids, or an odd ``k`` below ``len(ids) - 1``.
    """
    n = len(ids)
    if len(set(ids)) != n:
        raise ValueError("neighbour graph: repeated client ids")
    if k >= n - 1:
        return {a: [b for b in ids if b != a] for a in ids}
    if k < 2 or k % 2:
        raise ValueError(f"neighbour graph: k must be even and at least 2 below {n - 1} clients, got {k}")
    order = sorted(ids)
    random.Random(hashlib.sha256(seed).digest()).shuffle(order)
    pos = {cid: i for i, cid in enumerate(order)}
    rank = {cid: i for i, cid in enumerate(ids)}
    out: dict[str, list[str]] = {}
    for cid in ids:
        p = pos[cid]
        near = {order[(p + d) % n] for d in range(1, k // 2 + 1)} | {
            order[(p - d) % n] for d in range(1, k // 2 + 1)
        }
        out[cid] = sorted(near, key=rank.__getitem__)
    return out


def ring_scale(*, bits: int, clip: float, clients: int, levels: int = 0) -> float:
    """Steps per unit of the mean, so that the sum of ``clients`` stochastically rounded,
    weight-premultiplied updates within ``+-clip`` never wraps the ``bits``-bit ring.

    ``levels`` (QSGD's level count, ``qsgd:LEVELS`` under secagg; 0: the whole ring): at most
    that many steps per sign over ``clip``, QSGD's levels with the public range ``clip`` as its
    norm: the mean moves in steps of ``clip / levels`` (fewer levels when the ring has less room).

    Raises:
        ValueError: a ring too narrow for that many clients, or a bad ``bits``, ``clip`` or ``levels``.
    """
    if levels < 0:
        raise ValueError(f"levels must be at least 0 (0: the whole ring), got {levels}")
    if bits not in RING_BITS:
        raise ValueError(f"ring bits must be one of {RING_BITS}, got {bits}")
    if not (clip > 0 and clip < float("inf")):
        raise ValueError(f"clip must be positive and finite, got {clip}")
    room = (1 << (bits - 1)) - 1 - clients
    if room < 2:
        raise ValueError(f"a {bits}-bit ring cannot hold the sum of {clients} clients: use a wider ring")
    return (min(room, levels) if levels else room) / clip


def ring_dtype(bits: int) -> torch.dtype:
    """The dtype a ring element travels as (its bit pattern)."""
    return _WIRE[bits]


def quantize(
    update: torch.Tensor, *, weight: float, clip: float, scale: float, bits: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``update`` (flat, floating) clipped to ``+-clip``, premultiplied by ``weight`` (its share
    of the round's total) and rounded stochastically to ring integers (int64, in ``[0, 2^bits)``).
    Returns them and the rounding error in the update's units (for error feedback)."""
    if not 0 < weight <= 1:
        raise ValueError(f"a client's weight share must be in (0, 1], got {weight}")
    x = update.detach().to(torch.float64).clamp(-clip, clip)
    v = x * (weight * scale)
    low = torch.floor(v)
    up = torch.rand(v.shape, generator=generator, dtype=torch.float64) < (v - low)
    q = (low + up.to(torch.float64)).to(torch.int64)
    error = x - q.to(torch.float64) / (weight * scale)
    return q & ((1 << bits) - 1), error


def dequantize(total: torch.Tensor, *, scale: float, bits: int) -> torch.Tensor:
    """The float64 value of a ring sum (``int64`` in ``[0, 2^bits)``), read as signed."""
    half, mod = 1 << (bits - 1), 1 << bits
    signed = torch.where(total >= half, total - mod, total)
    return signed.to(torch.float64) / scale


def prg(seed: bytes, length: int, *, bits: int) -> torch.Tensor:
    """``length`` ring elements (int64, ``[0, 2^bits)``) from AES-256-CTR keyed by the 256-bit
    ``seed`` (zero nonce: each seed masks one vector)."""
    if len(seed) != 32:
        raise ValueError(f"a mask seed is 32 bytes (256 bits), got {len(seed)}")
    width = bits // 8
    stream = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update(bytes(length * width))
    raw = torch.frombuffer(bytearray(stream), dtype=_WIRE[bits]).to(torch.int64)
    return raw & ((1 << bits) - 1)


def ring_add(a: torch.Tensor, b: torch.Tensor, *, bits: int, sign: int = 1) -> torch.Tensor:
    """``a + sign * b`` modulo ``2^bits`` (int64 tensors in ``[0, 2^bits)``)."""
    return (a + b if sign > 0 else a - b) & ((1 << bits) - 1)


def to_wire(x: torch.Tensor, *, bits: int) -> torch.Tensor:
    """Ring elements (int64) as the dtype they travel in (the same bits)."""
    if bits == 8:
        return x.to(torch.uint8)
    half, mod = 1 << (bits - 1), 1 << bits
    return torch.where(x >= half, x - mod, x).to(_WIRE[bits])


def from_wire(x: torch.Tensor, *, bits: int) -> torch.Tensor:
    """What ``to_wire`` sent, back as int64 ring elements.

    Raises:
        ValueError: not the ring's dtype.
    """
    if x.dtype != _WIRE[bits]:
        raise ValueError(f"a {bits}-bit masked vector travels as {_WIRE[bits]}, got {x.dtype}")
    return x.to(torch.int64) & ((1 << bits) - 1)


def mask_sign(me: str, other: str) -> int:
    """The sign of the pairwise mask of ``me`` with ``other`` (opposite on the two sides)."""
    return 1 if me < other else -1


@dataclass(frozen=True)
class RoundPlan:
    """What the coordinator announces of a round: its run and number, the participants (in
    order), the neighbourhood size, the graph seed and the Shamir threshold."""

    run: str
    server_round: int
    me: str
    participants: tuple[str, ...]
    k: int
    graph_seed: bytes
    threshold: int

    def neighbours(self) -> list[str]:
        return neighbours(list(self.participants), k=self.k, seed=self.graph_seed)[self.me]
