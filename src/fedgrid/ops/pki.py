"""Administering fedgrid's certificate authority: what ``fedgrid certs`` does.

``init_ca`` makes the CA, ``issue`` and ``revoke`` manage leaf certificates, ``list_certs``
reads the registry and ``issue_token`` / ``revoke_token`` manage one-time enrollment tokens.
The directory format, the locking and the signing a running coordinator also needs (to enroll
a client) live in the kernel modules ``fedgrid.pki`` and ``fedgrid.pki_files`` (the files and
their lock); ``fedgrid.pki`` is re-exported here so that one import gives an operator the whole
PKI API.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from fedgrid import pki as ca
from fedgrid.errors import PKIError
from fedgrid.pki import *  # noqa: F403 - the kernel half: enroll, make_csr, the TLS checks
from fedgrid.pki import CA_CERT, CA_KEY, CLOCK_SKEW, CRL, INDEX, TOKENS, CertRecord, RevocationList  # noqa: F401
from fedgrid.pki_files import locked, read_json, write_json

__all__ = [
    "init_ca",
    "issue",
    "issue_token",
    "list_certs",
    "parse_duration",
    "revoke",
    "revoke_token",
    *ca.__all__,
]


def parse_duration(text: str) -> timedelta:
    """``30m``, ``24h``, ``7d``, ``90s`` or a sum such as ``1d12h``, as a positive timedelta.

    Raises:
        ValueError: not of that form, or zero.
    """
    units = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
    parts = re.findall(r"(\d+)([smhd])", text)
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        raise ValueError(f"duration {text!r}: expected a number and a unit s, m, h or d, e.g. 30m, 24h, 7d")
    total = sum((timedelta(**{units[u]: int(n)}) for n, u in parts), timedelta())
    if total <= timedelta():
        raise ValueError(f"duration {text!r} is zero")
    return total


def init_ca(directory: str | os.PathLike[str], *, name: str = "fedgrid CA", days: int = 3650) -> Path:
    """Creates a CA in ``directory`` (made 0700 if missing): ``ca.pem``, ``ca.key`` (0600),
    an empty ``crl.pem``, an empty ``index.json`` and ``tokens.json`` (0600).

    Args:
        directory: the certificate directory.
        name: the CA certificate's common name.
        days: how long the CA certificate is valid; every leaf expires by then.
    Returns:
        The path of ``ca.pem``.
    Raises:
        PKIError: the directory already holds a CA (it is never overwritten).
        ValueError: ``days`` is not positive or ``name`` is empty.
    """
    if days <= 0:
        raise ValueError(f"CA validity must be at least 1 day, got {days}")
    if not name or not name.isprintable():
        raise ValueError(f"CA name {name!r} must be non-empty printable text")
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    with locked(d):
        for existing in (ca.CA_CERT, ca.CA_KEY):
            if (d / existing).exists():
                raise PKIError(f"{d / existing} exists: refusing to overwrite an existing CA")
        key = ec.generate_private_key(ec.SECP256R1())
        now = ca.utcnow()
        cert = (
            x509.CertificateBuilder()
            .subject_name(ca.common_name_subject(name))
            .issuer_name(ca.common_name_subject(name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - ca.CLOCK_SKEW)
            .not_valid_after(now + timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        ca.write_atomic(
            d / ca.CA_KEY, ca.private_key_pem(key), 0o600
        )  # the key first: a ca.pem never exists without it
        ca.write_atomic(d / ca.CA_CERT, ca.certificate_pem(cert), 0o644)
        ca.save_records(d, [])
        write_json(d / ca.TOKENS, {"version": 1, "tokens": {}}, 0o600)
        ca.write_crl(d, cert, key, [])
    return d / ca.CA_CERT


def issue(
    directory: str | os.PathLike[str],
    name: str,
    *,
    server: bool = False,
    sans: Sequence[str] = (),
    days: int = 365,
) -> tuple[Path, Path]:
    """Issues a leaf certificate and its key (EC P-256, made here): ``NAME.pem``, ``NAME.key`` (0600).

    A client certificate has CN = ``name``, SAN URI ``fedgrid://client/NAME`` and EKU
    clientAuth only; a server certificate has SANs from ``sans`` (IP addresses where they
    parse as one, DNS names otherwise; ``localhost`` and ``127.0.0.1`` when empty) and EKU
    serverAuth only.

    Args:
        directory: the certificate directory (made by ``init_ca``).
        name: the client identity or server name, checked with ``check_identity``.
        server: issue a server certificate.
        sans: the server's host names and addresses.
        days: validity, clipped to the CA's.
    Returns:
        ``(cert_path, key_path)``.
    Raises:
        ValueError: ``name`` is not a valid identity or is reserved (``ca``, ``crl``); ``sans``
            given for a client; a SAN is malformed; ``days`` is not positive.
        PKIError: ``name`` already has a valid certificate, or the directory has no CA.
    """
    ca.check_file_name(name)
    if sans and not server:
        raise ValueError("subject alternative names (--san) are for server certificates (--server)")
    d = Path(directory)
    with locked(d):
        ca_cert, ca_key = ca.load_ca(d)
        records = ca.read_records(d)
        ca.check_name_free(records, name, ca.utcnow(), PKIError)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = ca.sign_leaf(
            ca_cert, ca_key, name=name, public_key=key.public_key(), server=server, sans=sans, days=days
        )
        ca.write_atomic(d / f"{name}.key", ca.private_key_pem(key), 0o600)
        ca.write_atomic(d / f"{name}.pem", ca.certificate_pem(cert), 0o644)
        ca.save_records(d, [*records, ca.record_of(cert, name, "server" if server else "client")])
    return d / f"{name}.pem", d / f"{name}.key"


def revoke(directory: str | os.PathLike[str], name: str) -> list[int]:
    """Revokes every unrevoked certificate issued to ``name`` and rewrites ``crl.pem``.

    Returns:
        The serials revoked now.
    Raises:
        PKIError: no certificate was ever issued to ``name``, or all of them are revoked already.
    """
    d = Path(directory)
    with locked(d):
        ca_cert, ca_key = ca.load_ca(d)
        records = ca.read_records(d)
        mine = [r for r in records if r.name == name]
        if not mine:
            raise PKIError(f"no certificate named {name!r} in {d / ca.INDEX}")
        if all(r.revoked for r in mine):
            raise PKIError(f"every certificate of {name!r} is revoked already")
        now = ca.utcnow()
        revoked = [r.serial for r in mine if not r.revoked]
        records = [replace(r, revoked_at=now) if r.name == name and not r.revoked else r for r in records]
        ca.save_records(d, records)
        ca.write_crl(d, ca_cert, ca_key, records)
    return revoked


def list_certs(directory: str | os.PathLike[str]) -> list[ca.CertRecord]:
    """Every certificate the CA in ``directory`` issued, in issue order (revoked ones included)."""
    return ca.read_records(Path(directory))


def issue_token(
    directory: str | os.PathLike[str], *, name: str | None = None, expires: timedelta = timedelta(hours=24)
) -> str:
    """Makes a one-time enrollment token; only its SHA-256 is stored, so show it once.

    Args:
        directory: the certificate directory.
        name: the only identity the token may enroll; ``None``: any free valid identity.
        expires: how long the token can be used.
    Returns:
        ``"<token_id>.<secret>"``.
    Raises:
        ValueError: ``name`` is not a valid identity or ``expires`` is not positive.
    """
    if name is not None:
        ca.check_file_name(name)
    if expires <= timedelta():
        raise ValueError(f"token expiry must be positive, got {expires}")
    d = Path(directory)
    token_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    with locked(d):
        ca.load_ca(d)  # a token for a directory without a CA could never be used
        store = read_json(d / ca.TOKENS, missing={"version": 1, "tokens": {}})
        store["tokens"][token_id] = {
            "hash": ca.token_digest(secret),
            "name": name,
            "created_at": ca.iso_utc(ca.utcnow()),
            "expires_at": ca.iso_utc(ca.utcnow() + expires),
            "used_at": None,
            "used_by": None,
            "revoked": False,
        }
        write_json(d / ca.TOKENS, store, 0o600)
    return f"{token_id}.{secret}"


def revoke_token(directory: str | os.PathLike[str], token_id: str) -> None:
    """Revokes an enrollment token so it can no longer be used.

    Raises:
        PKIError: no token has that id.
    """
    d = Path(directory)
    with locked(d):
        store = read_json(d / ca.TOKENS, missing={"version": 1, "tokens": {}})
        if token_id not in store["tokens"]:
            raise PKIError(f"no enrollment token with id {token_id!r} in {d / ca.TOKENS}")
        store["tokens"][token_id]["revoked"] = True
        write_json(d / ca.TOKENS, store, 0o600)
