"""What fedgrid's trust boundary checks at run time, on either side of a mutual-TLS connection:
a client identity (``check_identity``, ``identity_of``), a certificate's serial against a
CRL that is kept current (``RevocationList``), and a user's TLS files before they reach
gRPC (``load_pem_files``). Read-only, and indifferent to which CA made the files: the
coordinator and the client use it with fedgrid's own CA (``fedgrid.pki``) or with any other.
``fedgrid.pki`` re-exports every public name here.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedgrid.errors import PKIError

__all__ = [
    "IDENTITY_RE",
    "MAX_IDENTITY_CHARS",
    "RevocationList",
    "check_identity",
    "identity_of",
    "load_pem_files",
    "serial_of",
]

logger = logging.getLogger(__name__)

#: A client identity: letters, digits and ``.-_@:``, 1 to 128 characters. No spaces, no
#: control characters (a newline or an ANSI escape in a name would forge log lines).
IDENTITY_RE = re.compile(r"[A-Za-z0-9._@:-]{1,128}")
MAX_IDENTITY_CHARS = 128


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def iso_utc(t: datetime) -> str:
    """``t`` in UTC, ISO 8601 to the second (the format of the directory's JSON files)."""
    return t.astimezone(timezone.utc).isoformat(timespec="seconds")


def check_identity(name: str) -> str:
    """Checks a client identity (a certificate CN, a token's name, a file name in DIR).

    Returns:
        ``name`` unchanged.
    Raises:
        ValueError: ``name`` is not a string, is empty, is longer than 128 characters or
            contains a character outside letters, digits and ``.-_@:`` (the message says which).
    """
    if not isinstance(name, str):
        raise ValueError(f"identity must be a string, got {type(name).__name__}")
    if not name:
        raise ValueError("identity is empty")
    if len(name) > MAX_IDENTITY_CHARS:
        raise ValueError(f"identity is {len(name)} characters long; at most {MAX_IDENTITY_CHARS} are allowed")
    if IDENTITY_RE.fullmatch(name) is None:
        pos, ch = next((i, c) for i, c in enumerate(name) if IDENTITY_RE.fullmatch(c) is None)
        raise ValueError(
            f"identity {name!r} has character {ch!r} at position {pos}; allowed: letters, digits and . - _ @ :"
        )
    return name


def read_file(path: Path, what: str) -> bytes:
    """The bytes of ``path`` (``what`` names it in errors).

    Raises:
        PKIError: the file is missing, a directory or unreadable.
    """
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PKIError(f"{path}: {what} file not found") from None
    except IsADirectoryError:
        raise PKIError(f"{path}: is a directory, expected a {what} file") from None
    except PermissionError:
        raise PKIError(f"{path}: {what} file not readable (permission denied)") from None


# --- revocation on the hot path -------------------------------------------------------


class RevocationList:
    """The revoked serials of a CRL file, kept current for a server's per-call check.

    ``is_revoked`` costs a clock read; at most once per ``interval_s`` it also stats the file
    and, when its inode, mtime or size changed, re-reads it and verifies its signature against
    the CA. A rewrite that is unreadable or badly signed is logged and the last good list stays
    in force (revocations are never silently dropped); a missing or bad CRL at construction
    raises, so a server never starts without one. Thread-safe.

    Args:
        crl_path: the CRL (PEM or DER), rewritten atomically by ``revoke``.
        ca_cert_path: the CA certificate that must have signed it.
        interval_s: the longest time a changed file goes unnoticed.
        clock: a monotonic clock in seconds (tests pass their own).
    Raises:
        PKIError: at construction, the CA or the CRL is missing, unreadable or the CRL is not
            signed by the CA.
    """

    def __init__(
        self,
        crl_path: str | os.PathLike[str],
        ca_cert_path: str | os.PathLike[str],
        *,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.crl_path = Path(crl_path)
        self.interval_s = interval_s
        self._clock = clock
        self._ca = _load_certs(Path(ca_cert_path), "CA certificate")[0]
        ca_key = self._ca.public_key()
        if not isinstance(
            ca_key,
            (ec.EllipticCurvePublicKey, rsa.RSAPublicKey, ed25519.Ed25519PublicKey, ed448.Ed448PublicKey),
        ):
            raise PKIError(f"{ca_cert_path}: a {type(ca_key).__name__} CA key cannot sign a CRL")
        self._ca_key = ca_key
        self._lock = threading.Lock()
        self._seen = self._stat()
        if self._seen is None:
            raise PKIError(f"{self.crl_path}: CRL file not found")
        self._serials = self._parse(read_file(self.crl_path, "CRL"))
        self._good = True
        self._next_check = clock() + interval_s

    @property
    def serials(self) -> frozenset[int]:
        """The revoked serials in force."""
        return self._serials

    def is_revoked(self, serial: int) -> bool:
        """Whether ``serial`` is on the list (re-read first when the file changed and the interval passed)."""
        if self._clock() >= self._next_check:
            self.reload(force=False)
        return serial in self._serials

    def reload(self, *, force: bool = True) -> bool:
        """Re-reads the file now (``force``) or when its inode, mtime or size changed.

        Returns:
            True when the list in force is the file's current content; False when the file is
            missing or bad and the last good list stays (logged as an error).
        """
        with self._lock:
            self._next_check = self._clock() + self.interval_s
            seen = self._stat()
            if seen == self._seen and not force:
                return self._good
            self._seen = seen  # a bad file is reported once, not every interval
            try:
                if seen is None:
                    raise PKIError(f"{self.crl_path}: CRL file not found")
                self._serials = self._parse(read_file(self.crl_path, "CRL"))
                self._good = True
            except PKIError as exc:
                logger.error(
                    "keeping the last good revocation list (%d revoked serials): %s", len(self._serials), exc
                )
                self._good = False
            return self._good

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.crl_path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _parse(self, data: bytes) -> frozenset[int]:
        try:
            crl = (
                x509.load_pem_x509_crl(data)
                if data.lstrip().startswith(b"-----BEGIN")
                else x509.load_der_x509_crl(data)
            )
        except ValueError as exc:
            raise PKIError(f"{self.crl_path}: not a CRL ({exc})") from None
        if crl.issuer != self._ca.subject or not crl.is_signature_valid(self._ca_key):
            raise PKIError(f"{self.crl_path}: CRL not signed by the CA {self._ca.subject.rfc4514_string()}")
        return frozenset(r.serial_number for r in crl)


# --- inspecting certificates ----------------------------------------------------------


def _as_cert(cert: bytes | x509.Certificate) -> x509.Certificate:
    if isinstance(cert, x509.Certificate):
        return cert
    if cert.lstrip().startswith(b"-----BEGIN"):
        return x509.load_pem_x509_certificate(cert)
    return x509.load_der_x509_certificate(cert)


def serial_of(cert: bytes | x509.Certificate) -> int:
    """The serial number of a certificate (PEM, DER or loaded): what ``RevocationList`` checks."""
    return _as_cert(cert).serial_number


def identity_of(cert: bytes | x509.Certificate) -> str:
    """The client identity of a client certificate: its common name, checked.

    Args:
        cert: PEM (the first certificate is taken) or DER, e.g. gRPC's ``x509_pem_cert``.
    Raises:
        ValueError: not a certificate; no clientAuth extended key usage (a server certificate
            is not a client identity); no common name, several, or one that fails ``check_identity``.
    """
    c = _as_cert(cert)
    try:
        eku = c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        raise ValueError(
            "not a client certificate: it has no extended key usage (clientAuth required)"
        ) from None
    if ExtendedKeyUsageOID.CLIENT_AUTH not in eku:
        raise ValueError("not a client certificate: its extended key usage lacks clientAuth")
    cns = c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(cns) != 1:
        raise ValueError(f"client certificate has {len(cns)} common names; exactly one is its identity")
    value = cns[0].value
    return check_identity(value if isinstance(value, str) else value.decode("ascii", "replace"))


def _load_certs(path: Path, what: str) -> list[x509.Certificate]:
    data = read_file(path, what)
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise PKIError(f"{path}: not a PEM {what} (no -----BEGIN CERTIFICATE----- line)")
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise PKIError(f"{path}: malformed PEM {what} ({exc})") from None


def _public_der(key: Any) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _signed_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
        return True
    except (ValueError, TypeError, InvalidSignature):
        return False


def load_pem_files(
    ca: str | os.PathLike[str],
    cert: str | os.PathLike[str],
    key: str | os.PathLike[str],
) -> tuple[bytes, bytes, bytes]:
    """Reads a TLS identity (``--ca``, ``--cert``, ``--key``) and checks it before any
    connection does, so a wrong file fails with its name rather than as a handshake error.

    Files from any PKI work (openssl, a corporate CA): ``ca`` may be a bundle of several
    certificates, ``cert`` may carry intermediates after the leaf, keys may be EC or RSA.

    Returns:
        ``(ca_bytes, cert_bytes, key_bytes)``, the files as read, for gRPC's credentials.
    Raises:
        PKIError: a file is missing or not PEM; the key is encrypted or does not match the
            certificate; the certificate is not signed by a certificate of the bundle (through
            its intermediates); the certificate or its CA is expired or not yet valid.
    """
    ca_path, cert_path, key_path = Path(ca), Path(cert), Path(key)
    cas = _load_certs(ca_path, "CA certificate bundle")
    chain = _load_certs(cert_path, "certificate")
    key_bytes = read_file(key_path, "private key")
    if b"PRIVATE KEY-----" not in key_bytes:
        raise PKIError(f"{key_path}: not a PEM private key (no -----BEGIN ... PRIVATE KEY----- line)")
    try:
        private = serialization.load_pem_private_key(key_bytes, password=None)
    except TypeError:
        raise PKIError(f"{key_path}: the private key is encrypted; gRPC needs it unencrypted") from None
    except ValueError as exc:
        raise PKIError(f"{key_path}: malformed private key ({exc})") from None
    leaf = chain[0]
    if _public_der(private.public_key()) != _public_der(leaf.public_key()):
        raise PKIError(f"{key_path}: the private key does not match the certificate {cert_path}")
    now = _utcnow()
    current, anchor = leaf, None
    for _ in range(len(chain)):
        anchor = next((c for c in cas if _signed_by(current, c)), None)
        if anchor is not None:
            break
        step = next((c for c in chain[1:] if c is not current and _signed_by(current, c)), None)
        if step is None:
            break
        current = step
    if anchor is None:
        raise PKIError(
            f"{cert_path}: certificate {leaf.subject.rfc4514_string()} is not signed by any certificate in {ca_path}"
        )
    for c, path in ((leaf, cert_path), (anchor, ca_path)):
        if now > c.not_valid_after_utc:
            raise PKIError(
                f"{path}: certificate {c.subject.rfc4514_string()} expired on {iso_utc(c.not_valid_after_utc)}"
            )
        if now < c.not_valid_before_utc:
            raise PKIError(
                f"{path}: certificate {c.subject.rfc4514_string()} is not valid before {iso_utc(c.not_valid_before_utc)}"
            )
    return read_file(ca_path, "CA certificate bundle"), read_file(cert_path, "certificate"), key_bytes
