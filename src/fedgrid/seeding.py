"""Seeds derived from named parts, identical in every process (``hash`` is salted per process),
and the lock on torch's process-wide random generators."""

from __future__ import annotations

import hashlib
import threading

__all__ = ["derive_seed", "RNG_LOCK"]

#: torch's default random generators are process-wide: whoever draws from them (a client's
#: training, overlapped DiLoCo's background steps, a model initialized under a seed, a
#: stochastic codec without its own generator) holds this lock around a
#: ``torch.random.fork_rng``, so threads of one process never interleave their draws.
RNG_LOCK = threading.Lock()


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (their ``repr``), stable across processes and runs."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
