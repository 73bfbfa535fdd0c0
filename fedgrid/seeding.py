"""Seeds derived from named parts, identical in every process (``hash`` is salted per process)."""

from __future__ import annotations

import hashlib

__all__ = ["derive_seed"]


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (their ``repr``), stable across processes and runs."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
