"""The cryptography of SecAgg+, all from ``cryptography``, with no I/O: X25519 key agreement
and HKDF-SHA256, AES-GCM share envelopes whose associated data binds sender, receiver, round
and run, and key adverts signed with Ed25519 by the key of the client's identity.

An identity's Ed25519 public key comes from a ``Keyring``: the name a client's certificate
(or enrollment) proves, mapped to its signing key. A server relaying the adverts cannot swap a
client's keys without that client's signing key.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedgrid.errors import FedgridError

__all__ = [
    "SecAggRefusedError",
    "Keyring",
    "PinnedKeys",
    "Advert",
    "make_advert",
    "read_advert",
    "raw_public",
    "raw_private",
    "seal",
    "open_sealed",
    "mask_seed",
    "pack_fields",
    "unpack_fields",
    "SELF",
    "KEY",
    "encode_unmask",
    "decode_unmask",
]

_ADVERT_MAGIC = b"FGSA1"


class SecAggRefusedError(FedgridError):
    """A secure-aggregation client refuses a request that could reveal what its masks hide
    (both shares of one client), or a message it cannot authenticate; it sends nothing."""


class Keyring(Protocol):
    """The Ed25519 public key of each identity allowed in a round."""

    def public_key(self, name: str, credential: bytes = b"") -> Ed25519PublicKey | None:
        """The identity's key, or ``None`` for an unknown identity; ``credential`` is what
        its advert carries to prove the key (``secagg_identity.CertificateKeyring``).

        Raises:
            SecAggRefusedError: a credential that does not prove the key for ``name``.
        """


class PinnedKeys:
    """A ``Keyring`` from a fixed map of identity to public key (simulation, tests, or keys
    distributed with the certificates)."""

    def __init__(self, keys: Mapping[str, Ed25519PublicKey]) -> None:
        self._keys = dict(keys)

    def public_key(self, name: str, credential: bytes = b"") -> Ed25519PublicKey | None:
        return self._keys.get(name)


def raw_public(key: X25519PrivateKey | Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def raw_private(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def pack_fields(*fields: bytes) -> bytes:
    """``fields``, each behind its 2-byte big-endian length: the form of every SecAgg+ message body."""
    return b"".join(struct.pack(">H", len(f)) + f for f in fields)


def unpack_fields(data: bytes, count: int) -> list[bytes]:
    """The ``count`` fields ``pack_fields`` wrote.

    Raises:
        SecAggRefusedError: ``data`` is truncated or has bytes left over.
    """
    out, at = [], 0
    for _ in range(count):
        if at + 2 > len(data):
            raise SecAggRefusedError("a malformed secure-aggregation message (truncated)")
        (size,) = struct.unpack_from(">H", data, at)
        at += 2
        if at + size > len(data):
            raise SecAggRefusedError("a malformed secure-aggregation message (truncated)")
        out.append(data[at : at + size])
        at += size
    if at != len(data):
        raise SecAggRefusedError("a malformed secure-aggregation message (trailing bytes)")
    return out


def _context(run: str, server_round: int) -> bytes:
    return pack_fields(run.encode(), str(server_round).encode())


@dataclass(frozen=True)
class Advert:
    """A client's public keys for one round: ``cipher`` (X25519, envelopes) and ``mask``
    (X25519, pairwise masks), from client ``client_id`` of identity ``name``, with what
    proves its signing key for that identity (``credential``, may be empty)."""

    client_id: str
    name: str
    cipher: bytes
    mask: bytes
    credential: bytes = b""


def make_advert(signer: Ed25519PrivateKey, *, advert: Advert, run: str, server_round: int) -> bytes:
    """``advert`` encoded and signed with the identity's key, bound to ``run`` and ``server_round``."""
    body = pack_fields(
        advert.client_id.encode(), advert.name.encode(), advert.cipher, advert.mask, advert.credential
    )
    signature = signer.sign(_ADVERT_MAGIC + _context(run, server_round) + body)
    return _ADVERT_MAGIC + pack_fields(body, signature)


def read_advert(payload: bytes, *, sender: str, run: str, server_round: int, keyring: Keyring) -> Advert:
    """The advert relayed from ``sender``, checked: well formed, from ``sender``, of this run
    and round, signed by the key ``keyring`` holds for its identity.

    Raises:
        SecAggRefusedError: any check failed (naming which).
    """
    if not payload.startswith(_ADVERT_MAGIC):
        raise SecAggRefusedError(f"advert from {sender[:64]!r}: not a key advert")
    body, signature = unpack_fields(payload[len(_ADVERT_MAGIC) :], 2)
    cid, name, cipher, mask, credential = unpack_fields(body, 5)
    advert = Advert(cid.decode(errors="replace"), name.decode(errors="replace"), cipher, mask, credential)
    if advert.client_id != sender:
        raise SecAggRefusedError(
            f"advert relayed from {sender[:64]!r} names client {advert.client_id[:64]!r}"
        )
    if len(cipher) != 32 or len(mask) != 32:
        raise SecAggRefusedError(f"advert from {sender[:64]!r}: keys are not 32-byte X25519 keys")
    key = keyring.public_key(advert.name, advert.credential)
    if key is None:
        raise SecAggRefusedError(f"advert from {sender[:64]!r}: unknown identity {advert.name[:64]!r}")
    try:
        key.verify(signature, _ADVERT_MAGIC + _context(run, server_round) + body)
    except InvalidSignature:
        raise SecAggRefusedError(
            f"advert from {sender[:64]!r}: its signature does not verify for identity "
            f"{advert.name[:64]!r}, run and round {server_round}"
        ) from None
    return advert


def _derive(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def _agree(mine: X25519PrivateKey, theirs: bytes) -> bytes:
    return mine.exchange(X25519PublicKey.from_public_bytes(theirs))


def _aad(sender: str, receiver: str, run: str, server_round: int) -> bytes:
    return (
        b"fedgrid-secagg-envelope"
        + pack_fields(sender.encode(), receiver.encode())
        + _context(run, server_round)
    )


def seal(
    mine: X25519PrivateKey,
    theirs: bytes,
    plaintext: bytes,
    *,
    sender: str,
    receiver: str,
    run: str,
    server_round: int,
) -> bytes:
    """``plaintext`` encrypted for ``receiver`` (AES-256-GCM, key from X25519 + HKDF), its
    associated data binding sender, receiver, run and round."""
    key = _derive(_agree(mine, theirs), b"fedgrid-secagg-envelope-key")
    nonce = os.urandom(12)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, _aad(sender, receiver, run, server_round))


def open_sealed(
    mine: X25519PrivateKey,
    theirs: bytes,
    envelope: bytes,
    *,
    sender: str,
    receiver: str,
    run: str,
    server_round: int,
) -> bytes:
    """What ``seal`` sealed.

    Raises:
        SecAggRefusedError: tampered, or sealed for another sender, receiver, run or round.
    """
    key = _derive(_agree(mine, theirs), b"fedgrid-secagg-envelope-key")
    try:
        return AESGCM(key).decrypt(envelope[:12], envelope[12:], _aad(sender, receiver, run, server_round))
    except (InvalidTag, ValueError):
        raise SecAggRefusedError(
            f"envelope from {sender[:64]!r} does not open: tampered, or sealed for another "
            f"receiver, run or round than round {server_round}"
        ) from None


def mask_seed(mine: X25519PrivateKey, theirs: bytes, *, run: str, server_round: int) -> bytes:
    """The 256-bit pairwise mask seed two clients agree on for this run and round."""
    return _derive(_agree(mine, theirs), b"fedgrid-secagg-mask" + _context(run, server_round))


#: The kinds of share an unmask answer carries: of a self-mask seed, of a mask key.
SELF, KEY = b"b", b"s"


def encode_unmask(entries: Sequence[tuple[str, bytes, bytes]]) -> bytes:
    """An unmask answer: (owner id, ``SELF`` or ``KEY``, share) per entry."""
    return pack_fields(*(pack_fields(owner.encode(), kind, share) for owner, kind, share in entries))


def decode_unmask(payload: bytes) -> list[tuple[str, bytes, bytes]]:
    out: list[tuple[str, bytes, bytes]] = []
    at = 0
    while at < len(payload):
        size = int.from_bytes(payload[at : at + 2], "big")
        owner, kind, share = unpack_fields(payload[at + 2 : at + 2 + size], 3)
        out.append((owner.decode(errors="replace"), kind, share))
        at += 2 + size
    return out
