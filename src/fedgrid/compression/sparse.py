"""Sparsifiers: ``topk[:FRACTION[:scaled]]`` (largest magnitudes) and ``randk[:FRACTION[:unbiased]]`` (uniform sample).

Both keep ``k = k_for(n)`` of a tensor's ``n`` elements, ``k = clamp(floor(FRACTION * n + 1/2), 1, n)``,
send those values exactly (in the tensor's own dtype) and zero the rest; both are biased,
contractive compressors meant to run under error feedback: ``topk`` satisfies
``||x - x^||^2 <= (1 - k/n) ||x||^2`` for every ``x``, ``randk`` in expectation. ``randk``
does not rescale by ``n/k`` (that would make it unbiased but multiply its variance; with
error feedback the unscaled form is the one with guarantees, Stich et al. 2018).

``randk:FRACTION:unbiased`` is the unbiased form: the receiver multiplies the kept values by
``n/k``, so ``E[x^] = x`` with ``E||x^ - x||^2 = (n/k - 1) ||x||^2``. That is not contractive
(for ``k < n/2``), so it runs without error feedback (the ``auto`` rule's choice for it), and
averaging over clients, whose samples are independent, divides the variance by their number
(the QSGD / rand-k analyses of distributed SGD: Alistarh et al. 2017, Stich et al. 2018;
Wangni et al. 2018). Without error feedback nothing waits in a residual, so a federated
round moves by the full update in expectation: with error feedback the unscaled form sends
a share ``k/n`` of a client's pending update per participation, which needs on the order of
``n/k`` participations to catch up, far more than a short run gives a client.

``topk:FRACTION:scaled`` compensates the shrinkage of the step instead: the body carries one
float32 per tensor, ``s = ||x||^2 / ||topk(x)||^2`` (at least 1; capped where a kept value
times it would overflow the dtype), and the receiver multiplies the kept values by it, so
``<x^, x> = ||x||^2``: the decoded update moves as far along ``x`` as ``x`` itself, with
``||x - x^||^2 = (s - 1) ||x||^2``. That is not contractive where top-k keeps less than half
of the energy, so it runs without error feedback (``auto``'s choice; a residual rule is
refused). Under FedAvg a sparse upload without it moves the model about a third as far along
the mean update as ``none`` does (``docs/links.rst``).

``auto`` error feedback (the default) runs ``topk`` with ``momentum:0.5`` and the unbiased
``randk`` with none. Defaults when the spec names no fraction: ``topk`` keeps 0.1 (``DEFAULT_TOPK``), ``randk``
is ``randk:0.25:unbiased`` (``DEFAULT_RANDK``): each is the smallest fraction tried that
stays within 0.05 of uncompressed accuracy after 5 digits rounds (``docs/compression.md``).

Body: u64 ``k``, (``scaled``: float32 ``s``,) the ``k`` values, then the sorted indices in the smallest of four
formats (fixed-width integers, a bitmap, LEB128 varints of the gaps, or a Golomb-Rice code of the
gaps; see ``_payload``).
The decoder checks the count against the spec, every index against the shape, and that
indices strictly increase (so none repeats).
"""

from __future__ import annotations

import math
import struct
from abc import abstractmethod

import numpy as np
import torch

from fedgrid.compression._payload import Reader, decode_indices, encode_indices, max_index_bytes, numel
from fedgrid.compression.base import FloatCodec

__all__ = ["SparseCodec", "TopKCodec", "ScaledTopKCodec", "RandKCodec", "DEFAULT_TOPK", "DEFAULT_RANDK"]

#: The fraction of a bare ``topk`` spec.
DEFAULT_TOPK = 0.1
#: What a bare ``randk`` spec means: the fraction, and the unbiased form.
DEFAULT_RANDK = (0.25, True)

_VALUE_NP = {torch.float16: "<f2", torch.float32: "<f4", torch.float64: "<f8", torch.bfloat16: "<i2"}


class SparseCodec(FloatCodec):
    """Shared body format of ``topk`` and ``randk``; subclasses choose the indices.

    Args:
        fraction: share of elements kept, in (0, 1].
    """

    family = ""
    unbiased = False

    def __init__(self, fraction: float) -> None:
        if not (math.isfinite(fraction) and 0.0 < fraction <= 1.0):
            raise ValueError(f"{self.family} fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction
        self.name = f"{self.family}:{fraction!r}"

    def k_for(self, n: int) -> int:
        """Elements kept of ``n`` (the same on both ends: it depends on the spec and shape only)."""
        return min(n, max(1, math.floor(self.fraction * n + 0.5)))

    @abstractmethod
    def _select(self, flat: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
        """Indices (any order, no repeats) of the ``k`` elements of ``flat`` to keep."""

    #: True when the body carries one float32 factor that the receiver applies to the kept
    #: values (``topk:F:scaled``); 0 bytes otherwise.
    scaled = False

    def _max_body(self, shape: tuple[int, ...], dtype: torch.dtype) -> int | None:
        n = numel(shape)
        k = self.k_for(n)
        return 8 + 4 * self.scaled + k * dtype.itemsize + 1 + max_index_bytes(n, k)

    def _encode_body(
        self, x: torch.Tensor, *, generator: torch.Generator | None, key: str | None
    ) -> list[bytes]:
        flat = x.reshape(-1)
        n = flat.numel()
        k = self.k_for(n)
        idx = self._select(flat, k, generator).sort().values
        values = flat[idx].to("cpu").contiguous()
        value_bytes = values.view(torch.uint8).numpy().tobytes()
        head = [k.to_bytes(8, "little")]
        if self.scaled:
            head.append(struct.pack("<f", _energy_scale(flat, values)))
        return [*head, value_bytes, encode_indices(idx.to("cpu").numpy(), n)]

    def _decode_body(self, reader: Reader, *, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = numel(shape)
        k = self.k_for(n)
        reader.expect(8, k, "count")
        scale = float(reader.array("<f4", 1, "scale")[0]) if self.scaled else 1.0
        if not (math.isfinite(scale) and scale >= 1.0):
            raise reader.fail(f"scale must be finite and at least 1, got {scale}")
        values = torch.from_numpy(reader.array(_VALUE_NP[dtype], k, "values")).view(dtype)
        if not bool(torch.isfinite(values).all()):
            raise reader.fail("values hold NaN or Inf")
        idx = torch.from_numpy(decode_indices(reader, n, k))
        if self.scaled:
            values = (values.double() * scale).to(dtype)
            if not bool(torch.isfinite(values).all()):
                raise reader.fail(f"values times the scale {scale} overflow {dtype}")
        out = torch.zeros(n, dtype=dtype)
        out[idx] = values * (n / k) if self.unbiased else values
        return out


class TopKCodec(SparseCodec):
    """``topk:FRACTION``: the ``k`` elements of largest magnitude (ties broken by ``torch.topk``)."""

    family = "topk"
    #: Measured: classic EF's residual arrives rounds late and costs accuracy under FedAvg
    #: (``docs/links.rst``); one that fades by half per step keeps most of what it adds.
    auto_feedback = "momentum:0.5"

    def _select(self, flat: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
        magnitude = flat.abs()
        if flat.device.type != "cpu":
            return torch.topk(magnitude, k, sorted=False).indices
        # On CPU numpy's introselect is several times faster than torch.topk.
        if magnitude.dtype is torch.bfloat16 or magnitude.dtype is torch.float16:
            magnitude = magnitude.float()
        n = flat.numel()
        return torch.from_numpy(np.argpartition(magnitude.numpy(), n - k)[n - k :])


class ScaledTopKCodec(TopKCodec):
    """``topk:FRACTION:scaled``: top-k whose receiver multiplies the kept values by
    ``s = ||x||^2 / ||topk(x)||^2`` (one float32 in the body), so ``<x^, x> = ||x||^2``."""

    scaled = True
    contractive = False
    auto_feedback = "none"

    def __init__(self, fraction: float) -> None:
        super().__init__(fraction)
        self.name += ":scaled"


def _energy_scale(flat: torch.Tensor, kept: torch.Tensor) -> float:
    """``||flat||^2 / ||kept||^2`` in float64, at least 1, and capped so that no kept value
    times it overflows the dtype or float32 (1 when nothing nonzero is kept)."""
    part = float(kept.double().square().sum())
    if part == 0.0:
        return 1.0
    ceiling = min(torch.finfo(flat.dtype).max, torch.finfo(torch.float32).max)
    cap = ceiling / float(kept.double().abs().max()) * (1 - 2**-20)  # float32 rounding of the scale
    return max(1.0, min(float(flat.double().square().sum()) / part, cap))


class RandKCodec(SparseCodec):
    """``randk:FRACTION``: ``k`` elements drawn uniformly without replacement from ``generator``;
    ``unbiased``: the receiver scales them by ``n/k`` (``randk:FRACTION:unbiased``)."""

    family = "randk"
    stochastic = True

    def __init__(self, fraction: float, unbiased: bool = False) -> None:
        super().__init__(fraction)
        if unbiased:
            self.unbiased, self.contractive, self.auto_feedback = True, False, "none"
            self.name += ":unbiased"

    def _select(self, flat: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
        # One draw from ``generator`` seeds numpy's sampler, which picks k of n without
        # materialising a permutation of all n (torch.randperm would).
        device = generator.device if generator is not None else torch.device("cpu")
        seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator, device=device))
        chosen = np.random.default_rng(seed).choice(flat.numel(), size=k, replace=False, shuffle=False)
        return torch.from_numpy(chosen.astype(np.int64)).to(flat.device)
