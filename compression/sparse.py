"""Sparsifiers: ``topk[:FRACTION]`` (largest magnitudes) and ``randk[:FRACTION[:unbiased]]`` (uniform sample).

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

``auto`` error feedback (the default) runs ``topk`` with ``momentum:0.5`` and the unbiased
``randk`` with none. Defaults when the spec names no fraction: ``topk`` keeps 0.1 (``DEFAULT_TOPK``), ``randk``
is ``randk:0.25:unbiased`` (``DEFAULT_RANDK``): each is the smallest fraction tried that
stays within 0.05 of uncompressed accuracy after 5 digits rounds (``docs/compression.md``).

Body: u64 ``k``, the ``k`` values, then the sorted indices in the smallest of three
formats (fixed-width integers, a bitmap, or LEB128 varints of the gaps; see ``_payload``).
The decoder checks the count against the spec, every index against the shape, and that
indices strictly increase (so none repeats).
"""

from __future__ import annotations

import math
from abc import abstractmethod

import numpy as np
import torch

from fedgrid.compression._payload import Reader, decode_indices, encode_indices, max_index_bytes, numel
from fedgrid.compression.base import FloatCodec

__all__ = ["SparseCodec", "TopKCodec", "RandKCodec", "DEFAULT_TOPK", "DEFAULT_RANDK"]

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

    def _max_body(self, shape: tuple[int, ...], dtype: torch.dtype) -> int | None:
        n = numel(shape)
        k = self.k_for(n)
        return 8 + k * dtype.itemsize + 1 + max_index_bytes(n, k)

    def _encode_body(
        self, x: torch.Tensor, *, generator: torch.Generator | None, key: str | None
    ) -> list[bytes]:
        flat = x.reshape(-1)
        n = flat.numel()
        k = self.k_for(n)
        idx = self._select(flat, k, generator).sort().values
        values = flat[idx].to("cpu").contiguous()
        value_bytes = values.view(torch.uint8).numpy().tobytes()
        return [k.to_bytes(8, "little"), value_bytes, encode_indices(idx.to("cpu").numpy(), n)]

    def _decode_body(self, reader: Reader, *, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = numel(shape)
        k = self.k_for(n)
        reader.expect(8, k, "count")
        values = torch.from_numpy(reader.array(_VALUE_NP[dtype], k, "values")).view(dtype)
        if not bool(torch.isfinite(values).all()):
            raise reader.fail("values hold NaN or Inf")
        idx = torch.from_numpy(decode_indices(reader, n, k))
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
