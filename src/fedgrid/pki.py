"""The certificate authority behind fedgrid's trust boundary (mutual TLS).

A certificate directory holds one CA and everything it issued::

    ca.pem  ca.key (0600)   the CA: EC P-256, self-signed, CA:true, keyCertSign + cRLSign
    crl.pem                 the CRL, signed by the CA, listing every revoked serial
    index.json              the registry: name, serial, kind, validity, revoked and when
    tokens.json (0600)      enrollment tokens: only the SHA-256 of each secret is kept
    NAME.pem  NAME.key      leaf certificates (the key is 0600; enrolled clients keep theirs)

A client's identity is its certificate's common name, checked with ``check_identity``; it is
the key of the coordinator's membership and of canonical aggregation order, so it is limited to
printable ASCII that survives logs, file names and terminals. Client certificates carry only
the clientAuth extended key usage and server certificates only serverAuth, so a stolen
server key cannot log in as a client and the other way round.

Every write is atomic (a temporary file, then ``os.replace``) so that a reader, the
coordinator's ``RevocationList`` above all, never sees half a file; secrets are created
with mode 0600 rather than narrowed afterwards. Changes to ``index.json`` and
``tokens.json`` are made under an exclusive ``flock`` on ``DIR/.lock``, which is what makes
a one-time token usable once even when two enrollments race with it.

Private keys are stored unencrypted (gRPC reads them as is); the directory is created 0700.
The atomic writes, the JSON registries and the lock are ``fedgrid.pki_files``.

This module holds the directory format and what a running coordinator or client does with it:
a client's CSR (``make_csr``) and the coordinator's side of enrollment (``enroll``: a token for
a certificate). Administering the CA (``fedgrid certs``: init, issue, revoke, tokens) is the
operator tool ``fedgrid.ops.pki``; ``fedgrid.trust`` holds the read-only checks a running
coordinator or client makes (identities, the CRL, a user's own TLS files) and is re-exported here.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import (
    CertificateIssuerPrivateKeyTypes,
    CertificatePublicKeyTypes,
)
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedgrid.errors import CSRError, EnrollmentError, EnrollmentNameError, PKIError
from fedgrid.pki_files import locked, read_json, write_atomic, write_json
from fedgrid.trust import (
    IDENTITY_RE,
    MAX_IDENTITY_CHARS,
    RevocationList,
    check_identity,
    identity_of,
    iso_utc,
    load_pem_files,
    read_file,
    serial_of,
)

__all__ = [
    "CertRecord",
    "enroll",
    "make_csr",
    "write_atomic",
    # fedgrid.trust's, so that one import gives the whole PKI API
    "IDENTITY_RE",
    "MAX_IDENTITY_CHARS",
    "RevocationList",
    "check_identity",
    "identity_of",
    "load_pem_files",
    "serial_of",
]

CA_CERT, CA_KEY, CRL, INDEX, TOKENS = (
    "ca.pem",
    "ca.key",
    "crl.pem",
    "index.json",
    "tokens.json",
)
#: Names whose NAME.pem / NAME.key would be the CA's own files.
RESERVED_NAMES = frozenset({"ca", "crl"})
#: Leaf certificates start this long before issue, for clocks that run a little behind.
CLOCK_SKEW = timedelta(minutes=5)
CLIENT_URI_PREFIX = "fedgrid://client/"


def utcnow() -> datetime:
    """The time validity and token expiry are measured in (UTC); tests replace it."""
    return datetime.now(timezone.utc)


# --- names and durations --------------------------------------------------------------


def check_file_name(name: str) -> str:
    """``name`` if it is an identity that may name files in the directory (not ``ca`` or ``crl``).

    Raises:
        ValueError: not an identity (``check_identity``), or a reserved name.
    """
    check_identity(name)
    if name in RESERVED_NAMES:
        raise ValueError(f"name {name!r} is reserved: {name}.pem is the CA's own file")
    return name


def private_key_pem(key: CertificateIssuerPrivateKeyTypes) -> bytes:
    """``key`` as unencrypted PKCS#8 PEM (gRPC reads keys as they are)."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def certificate_pem(cert: x509.Certificate) -> bytes:
    """``cert`` as PEM."""
    return cert.public_bytes(serialization.Encoding.PEM)


def common_name_subject(name: str) -> x509.Name:
    """The X.509 name whose only attribute is the common name ``name``."""
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])


def load_ca(directory: Path) -> tuple[x509.Certificate, CertificateIssuerPrivateKeyTypes]:
    """The CA certificate and key of ``directory``.

    Raises:
        PKIError: no CA there, a file unreadable, or a key type other than EC or RSA.
    """
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    if not cert_path.exists():
        raise PKIError(
            f"{cert_path}: no CA in {directory}; create one with `fedgrid certs init --dir {directory}`"
        )
    cert = x509.load_pem_x509_certificate(read_file(cert_path, "CA certificate"))
    key = serialization.load_pem_private_key(read_file(key_path, "CA key"), password=None)
    if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
        raise PKIError(f"{key_path}: unsupported CA key type {type(key).__name__}")
    return cert, key


# --- the CA and its certificates ------------------------------------------------------


@dataclass(frozen=True)
class CertRecord:
    """One certificate in ``index.json``.

    Attributes:
        name: the identity (client) or host name (server) it was issued to.
        serial: its serial number.
        kind: ``"client"`` or ``"server"``.
        not_before, not_after: its validity (UTC).
        revoked_at: when it was revoked; ``None`` while it is not.
    """

    name: str
    serial: int
    kind: str
    not_before: datetime
    not_after: datetime
    revoked_at: datetime | None = None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def status(self, now: datetime | None = None) -> str:
        """``"revoked"``, ``"expired"`` or ``"valid"`` (at ``now``, default the current time)."""
        if self.revoked:
            return "revoked"
        return "expired" if (now or utcnow()) > self.not_after else "valid"

    def to_json(self) -> dict[str, Any]:
        """The entry in ``index.json`` (serial in hex: JSON readers outside Python lose 160-bit ints)."""
        return {
            "name": self.name,
            "serial": f"{self.serial:x}",
            "kind": self.kind,
            "not_before": iso_utc(self.not_before),
            "not_after": iso_utc(self.not_after),
            "revoked": self.revoked,
            "revoked_at": None if self.revoked_at is None else iso_utc(self.revoked_at),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CertRecord:
        """The record of an ``index.json`` entry written by ``to_json``."""
        return cls(
            name=d["name"],
            serial=int(d["serial"], 16),
            kind=d["kind"],
            not_before=datetime.fromisoformat(d["not_before"]),
            not_after=datetime.fromisoformat(d["not_after"]),
            revoked_at=None if d.get("revoked_at") is None else datetime.fromisoformat(d["revoked_at"]),
        )


def read_records(directory: Path) -> list[CertRecord]:
    """The certificates ``index.json`` lists.

    Raises:
        PKIError: a malformed entry.
    """
    index = read_json(directory / INDEX)
    try:
        return [CertRecord.from_json(d) for d in index["certs"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise PKIError(f"{directory / INDEX}: malformed certificate entry ({exc!r})") from None


def save_records(directory: Path, records: Sequence[CertRecord]) -> None:
    """Writes ``records`` as ``index.json`` (atomically; hold the directory's lock)."""
    write_json(directory / INDEX, {"version": 1, "certs": [r.to_json() for r in records]}, 0o644)


def check_name_free(records: Sequence[CertRecord], name: str, now: datetime, error: type[Exception]) -> None:
    """Raises ``error`` when ``name`` already has a certificate valid at ``now``."""
    for r in records:
        if r.name == name and r.status(now) == "valid":
            raise error(
                f"name {name!r} already has a valid certificate (serial {r.serial:x}); revoke it first"
            )


def _key_usage_signature() -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )


def _general_names(sans: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for san in sans:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(san)))
            continue
        except ValueError:
            pass
        if not san or not san.isascii() or any(c.isspace() or not c.isprintable() for c in san):
            raise ValueError(
                f"subject alternative name {san!r} is neither an IP address nor an ASCII DNS name"
            )
        names.append(x509.DNSName(san))
    return names


def sign_leaf(
    ca_cert: x509.Certificate,
    ca_key: CertificateIssuerPrivateKeyTypes,
    *,
    name: str,
    public_key: CertificatePublicKeyTypes,
    server: bool,
    sans: Sequence[str],
    days: int,
) -> x509.Certificate:
    """A leaf certificate for ``name`` (a server's, with ``sans``, or a client's), signed by the CA,
    valid from ``CLOCK_SKEW`` before now for ``days`` days (clipped to the CA's own validity).

    Raises:
        ValueError: ``days`` is not positive.
    """
    if days <= 0:
        raise ValueError(f"certificate validity must be at least 1 day, got {days}")
    now = utcnow()
    # A leaf cannot outlive its CA (verifiers would refuse it then anyway): clip it.
    not_after = min(now + timedelta(days=days), ca_cert.not_valid_after_utc)
    if server:
        eku, alt = ExtendedKeyUsageOID.SERVER_AUTH, _general_names(sans or ("localhost", "127.0.0.1"))
    else:
        eku, alt = ExtendedKeyUsageOID.CLIENT_AUTH, [x509.UniformResourceIdentifier(CLIENT_URI_PREFIX + name)]
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    return (
        x509.CertificateBuilder()
        .subject_name(common_name_subject(name))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage_signature(), critical=True)
        .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def record_of(cert: x509.Certificate, name: str, kind: str) -> CertRecord:
    """The ``index.json`` entry of ``cert``."""
    return CertRecord(
        name=name,
        serial=cert.serial_number,
        kind=kind,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
    )


def write_crl(
    directory: Path,
    ca_cert: x509.Certificate,
    ca_key: CertificateIssuerPrivateKeyTypes,
    records: Sequence[CertRecord],
) -> None:
    """Writes the CRL, signed by the CA, listing every revoked serial of ``records``."""
    now = utcnow()
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now)
        # The CRL is only rewritten on a revocation; an earlier next_update would make it look
        # stale to a verifier that checks it while nothing changed. It lives as long as the CA.
        .next_update(max(ca_cert.not_valid_after_utc, now + timedelta(days=1)))
        .add_extension(x509.CRLNumber(int(now.timestamp() * 1000)), critical=False)
    )
    for r in records:
        if r.revoked_at is not None:
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(r.serial).revocation_date(r.revoked_at).build()
            )
    crl = builder.sign(ca_key, hashes.SHA256())
    write_atomic(directory / CRL, crl.public_bytes(serialization.Encoding.PEM), 0o644)


# --- enrollment -----------------------------------------------------------------------


def token_digest(secret: str) -> str:
    """What ``tokens.json`` keeps of an enrollment token's secret: its SHA-256, in hex."""
    return hashlib.sha256(secret.encode()).hexdigest()


def make_csr(name: str, *, key_pem: bytes | None = None) -> tuple[bytes, bytes]:
    """A client's half of enrollment: a CSR for identity ``name``, signed by a new EC P-256
    key or by ``key_pem`` (a key an interrupted enrollment left, so a retry keeps it).

    Returns:
        ``(key_pem, csr_pem)``; the key never leaves the client.
    Raises:
        ValueError: ``name`` is not a valid identity; ``key_pem`` is not an unencrypted PEM
            EC or RSA private key.
    """
    check_identity(name)
    key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
    if key_pem is None:
        key = ec.generate_private_key(ec.SECP256R1())
    else:
        try:
            loaded = serialization.load_pem_private_key(key_pem, password=None)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not an unencrypted PEM private key ({exc})") from None
        if not isinstance(loaded, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
            raise ValueError(f"unsupported private key type {type(loaded).__name__}; use EC or RSA")
        key = loaded
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(common_name_subject(name))
        .sign(key, hashes.SHA256())
    )
    return private_key_pem(key), csr.public_bytes(serialization.Encoding.PEM)


def _csr_identity(csr_pem: bytes) -> tuple[str, CertificatePublicKeyTypes]:
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError:
        raise CSRError("CSR is not a PEM certificate request") from None
    if not csr.is_signature_valid:
        raise CSRError("CSR signature invalid")
    public = csr.public_key()
    if not (
        isinstance(public, ec.EllipticCurvePublicKey) and public.curve.name in ("secp256r1", "secp384r1")
    ) and not (isinstance(public, rsa.RSAPublicKey) and public.key_size >= 2048):
        raise CSRError(
            f"CSR key unsupported ({type(public).__name__}); use EC P-256/P-384 or RSA of 2048 bits or more"
        )
    cns = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(cns) != 1 or not isinstance(cns[0].value, str):
        raise CSRError(f"CSR must name exactly one common name (the identity), it has {len(cns)}")
    try:
        return check_file_name(cns[0].value), public
    except ValueError as exc:
        raise CSRError(f"CSR name invalid: {exc}") from None


def enroll(
    directory: str | os.PathLike[str], token: str, csr_pem: bytes, *, days: int = 365
) -> tuple[bytes, str]:
    """The coordinator's half of enrollment: spends a one-time token on a client certificate.

    Only the CSR's common name and public key are used; every extension is set here (EKU
    clientAuth, SAN ``fedgrid://client/NAME``). The token is marked used, under the directory
    lock, before the certificate is returned; two enrollments racing with one token get one
    certificate between them. ``tokens.json`` is written before ``index.json``, so a crash in
    between spends the token without issuing anything, never the other way round.

    Args:
        directory: the certificate directory.
        token: ``"<token_id>.<secret>"`` from ``issue_token``.
        csr_pem: the client's CSR (``make_csr``).
        days: the certificate's validity, clipped to the CA's.
    Returns:
        ``(cert_pem, name)``: the client certificate and the identity it carries.
    Raises:
        EnrollmentError: malformed or unknown token; token already used, expired or revoked;
            CSR unparsable, badly signed or with an invalid name; name mismatch with the
            token; the name already has a valid certificate.
    """
    d = Path(directory)
    token_id, dot, secret = token.strip().partition(".")
    if not dot or not token_id or not secret:
        raise EnrollmentError("malformed enrollment token: expected <token_id>.<secret>")
    name, public = _csr_identity(csr_pem)
    with locked(d):
        store = read_json(d / TOKENS, missing={"version": 1, "tokens": {}})
        entry = store["tokens"].get(token_id)
        # An unknown id and a wrong secret read the same: the answer reveals no valid id.
        if entry is None or not hmac.compare_digest(entry["hash"], token_digest(secret)):
            raise EnrollmentError("unknown enrollment token")
        now = utcnow()
        if entry["revoked"]:
            raise EnrollmentError(f"enrollment token {token_id} revoked")
        if entry["used_at"] is not None:
            raise EnrollmentError(f"enrollment token {token_id} already used (at {entry['used_at']})")
        if now >= datetime.fromisoformat(entry["expires_at"]):
            raise EnrollmentError(f"enrollment token {token_id} expired at {entry['expires_at']}")
        if entry["name"] is not None and entry["name"] != name:
            raise EnrollmentNameError(
                f"name mismatch: the token is for {entry['name']!r}, the CSR asks for {name!r}"
            )
        ca_cert, ca_key = load_ca(d)
        records = read_records(d)
        check_name_free(records, name, now, EnrollmentNameError)
        cert = sign_leaf(ca_cert, ca_key, name=name, public_key=public, server=False, sans=(), days=days)
        entry.update(used_at=iso_utc(now), used_by=name, serial=f"{cert.serial_number:x}")
        write_json(d / TOKENS, store, 0o600)
        save_records(d, [*records, record_of(cert, name, "client")])
        write_atomic(d / f"{name}.pem", certificate_pem(cert), 0o644)
        # The key of this certificate stays with the client; one left by an earlier `issue`
        # of the name would sit beside a certificate it does not match.
        (d / f"{name}.key").unlink(missing_ok=True)
    return certificate_pem(cert), name
