"""The arithmetic of DP-FedAvg (McMahan et al. 2018; adaptive clipping: Andrew et al. 2021):
clipping an update, Gaussian noise from a cryptographically secure stream, and the clip's
geometric update. The round engine's privacy stage (``fedgrid.server.privacy``) applies them.

**Noise.** Normals come from AES-256-CTR keystreams (``cryptography``): the stream of a round
and a purpose is keyed by ``HMAC-SHA256(run key, purpose | round)``, its 64-bit words become
uniforms in (0, 1] (53 bits each) and pairs of uniforms normals (Box-Muller, float64), then
scaled and cast to each tensor's dtype. Without the run key the noise cannot be predicted or
reproduced; with it, exactly (a resumed round draws the bits it drew before the crash).

``noise_share`` is the one function that draws noise for a sum of clients: the server's
central noise is the share of one party (``parties=1``); under secure aggregation each of ``n``
clients would add a share of ``parties=n`` from its own key, std ``std / sqrt(n)``, so that the
sum carries the same noise and the server never sees an unnoised sum.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections import OrderedDict
from typing import Mapping

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedgrid.aggregation.clipping import update_norm
from fedgrid.types import ModelState

__all__ = [
    "KEY_BYTES",
    "clip_update",
    "noise_share",
    "secure_normals",
    "stream_key",
    "split_noise",
    "next_clip",
    "update_norm",
    "CLIP_TARGET_QUANTILE",
    "CLIP_LEARNING_RATE",
]

#: Bytes of a run's noise key (an AES-256 key's).
KEY_BYTES = 32
#: Adaptive clipping (Andrew et al. 2021): the quantile of the update norms the clip tracks, and
#: its geometric learning rate (their recommended 0.5 and 0.2).
CLIP_TARGET_QUANTILE = 0.5
CLIP_LEARNING_RATE = 0.2
_TWO_POW_53 = float(2**53)


def stream_key(key: bytes, purpose: str, server_round: int) -> bytes:
    """The AES-256 key of ``purpose``'s stream in ``server_round``: ``HMAC-SHA256(key, purpose|round)``.

    Raises:
        ValueError: a run key shorter than ``KEY_BYTES``.
    """
    if len(key) < KEY_BYTES:
        raise ValueError(f"a noise key needs at least {KEY_BYTES} bytes, got {len(key)}")
    return hmac.new(key, f"fedgrid-dp|{purpose}|{server_round}".encode(), hashlib.sha256).digest()


def secure_normals(keystream: "_Keystream", count: int) -> torch.Tensor:
    """``count`` standard normals (float64) from the next bytes of ``keystream`` (Box-Muller)."""
    pairs = (count + 1) // 2
    words = np.frombuffer(keystream.read(16 * pairs), dtype="<u8")
    uniform = ((words >> np.uint64(11)).astype(np.float64) + 1.0) / _TWO_POW_53  # in (0, 1]
    u1, u2 = torch.from_numpy(uniform[0::2].copy()), torch.from_numpy(uniform[1::2].copy())
    radius = torch.sqrt(-2.0 * torch.log(u1))
    angle = (2.0 * math.pi) * u2
    return torch.stack((radius * torch.cos(angle), radius * torch.sin(angle)), dim=1).reshape(-1)[:count]


class _Keystream:
    """An AES-256-CTR keystream, read in order."""

    def __init__(self, key: bytes) -> None:
        self._enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()

    def read(self, n: int) -> bytes:
        return self._enc.update(bytes(n))


def noise_share(
    key: bytes,
    server_round: int,
    like: Mapping[str, torch.Tensor],
    *,
    std: float,
    parties: int = 1,
    purpose: str = "update",
) -> ModelState:
    """One party's share of Gaussian noise of std ``std`` on a sum of ``parties`` parties' tensors:
    normals of std ``std / sqrt(parties)`` shaped like ``like``'s floating tensors, in their dtypes
    (in name order, so the bits depend on the key, the round and the shapes alone).

    Raises:
        ValueError: a negative or non-finite ``std``, ``parties`` below 1, or a short key.
    """
    if not (math.isfinite(std) and std >= 0):
        raise ValueError(f"the noise std must be a finite number at least 0, got {std}")
    if parties < 1:
        raise ValueError(f"parties must be at least 1, got {parties}")
    stream = _Keystream(stream_key(key, purpose, server_round))
    scale = std / math.sqrt(parties)
    out: ModelState = OrderedDict()
    for name in sorted(like):
        t = like[name]
        if not t.dtype.is_floating_point:
            continue
        z = secure_normals(stream, t.numel()) * scale
        out[name] = z.reshape(t.shape).to(t.dtype)
    return out


def secure_normal(key: bytes, server_round: int, purpose: str) -> float:
    """One standard normal of ``purpose``'s stream in ``server_round`` (the clip-count noise)."""
    return float(secure_normals(_Keystream(stream_key(key, purpose, server_round)), 1)[0])


def clip_update(update: Mapping[str, torch.Tensor], clip: float) -> tuple[ModelState, float]:
    """``update`` scaled to L2 norm at most ``clip`` (its floating tensors together, float64;
    other tensors as they are), and its norm before.

    Raises:
        ValueError: a ``clip`` that is not a finite number above 0.
    """
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"the clip must be a finite number above 0, got {clip}")
    norm = update_norm(update)
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    if scale == 1.0:
        return OrderedDict(update), norm
    clipped: ModelState = OrderedDict(
        (n, (t.to(torch.float64) * scale).to(t.dtype) if t.dtype.is_floating_point else t)
        for n, t in update.items()
    )
    return clipped, norm


def split_noise(noise_multiplier: float, expected_clients: int) -> tuple[float, float]:
    """The noise multipliers of the updates' sum and of the unclipped count under adaptive
    clipping, whose composition is ``noise_multiplier`` (Andrew et al., Theorem 1:
    ``sigma_update = (sigma**-2 - (2 sigma_count)**-2) ** -1/2``). The count's is
    ``max(expected_clients / 20, noise_multiplier)`` (their ``n / 20``, and never more than a
    quarter of the privacy: ``sigma_update`` is at most 1.155 ``sigma``).

    Raises:
        ValueError: ``noise_multiplier`` not above 0, or ``expected_clients`` below 1.
    """
    if not noise_multiplier > 0 or expected_clients < 1:
        raise ValueError(
            f"needs noise_multiplier > 0 and expected_clients >= 1, got {noise_multiplier}, {expected_clients}"
        )
    sigma_count = max(expected_clients / 20.0, noise_multiplier)
    sigma_update = (noise_multiplier**-2 - (2.0 * sigma_count) ** -2) ** -0.5
    return sigma_update, sigma_count


def next_clip(clip: float, unclipped: float, clients: int, count_noise: float) -> float:
    """The clip of the next round (Andrew et al.): ``clip * exp(-lr * (b - target))``, where
    ``b = (unclipped + count_noise) / clients`` is the noised share of updates that were not
    clipped (``count_noise``: a normal of std ``sigma_count``, already scaled)."""
    share = (unclipped + count_noise) / clients
    return clip * math.exp(-CLIP_LEARNING_RATE * (share - CLIP_TARGET_QUANTILE))
