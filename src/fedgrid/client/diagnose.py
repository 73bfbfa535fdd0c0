"""Why a client's connection to its coordinator failed, when it can never succeed as configured.

gRPC reports a failed TLS handshake as UNAVAILABLE, the code of a coordinator that is down
for a moment, and its words ("Hostname Verification Check failed", "Socket closed") name
neither the certificate nor the fix. When a connection fails that way, ``diagnose`` dials
the coordinator once with the standard library's TLS and looks at what it presents:

- a certificate whose names (SANs) do not include the host dialled: the names, and
  ``--server-name NAME`` (or a certificate issued with ``--san HOST``);
- a certificate not signed by a CA in ``--ca``, expired or not yet valid, or not made for a
  server: which, and what to do;
- a coordinator that closes the connection right after the handshake: it refuses this
  client's certificate (another CA, or revoked at the handshake);
- a coordinator that answers a TLS hello with plaintext, or a plaintext client that meets a
  coordinator presenting a certificate: the two sides disagree about TLS.

Anything else (nothing listening, a timeout, a handshake that succeeds) is transient: the
caller goes on retrying. The probe is a diagnosis only: the gRPC channel's own handshake
decides what is trusted.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import ssl
from datetime import datetime, timezone
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedgrid.proto.tls import TLSFiles
from fedgrid.textsafe import escape

__all__ = ["diagnose", "explain_certificate", "certificate_names", "PROBE_TIMEOUT_S"]

#: Longest a probe waits to connect, for the handshake and for the coordinator's first bytes.
PROBE_TIMEOUT_S = 3.0
#: OpenSSL's verify codes for a name not in the certificate (host, IP address).
_NAME_MISMATCH = (62, 64)
#: A certificate name printed as it is; anything else (the peer wrote it) is escaped.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9*._: -]{1,253}")


def certificate_names(cert: x509.Certificate) -> list[str]:
    """The DNS names and IP addresses a certificate holds (its SANs), in order."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    names = [
        *san.get_values_for_type(x509.DNSName),
        *(str(ip) for ip in san.get_values_for_type(x509.IPAddress)),
    ]
    return [_safe(name) for name in names]  # the peer wrote them


def _subject(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return f"CN={_text(names[0].value)}" if names else escape(cert.subject.rfc4514_string(), 128)


def _issuer(cert: x509.Certificate) -> str:
    names = cert.issuer.get_attributes_for_oid(NameOID.COMMON_NAME)
    return f"CN={_text(names[0].value)}" if names else escape(cert.issuer.rfc4514_string(), 128)


def _text(value: str | bytes) -> str:
    return _safe(value.decode("utf-8", "replace") if isinstance(value, bytes) else value)


def _safe(name: str) -> str:
    return name if _PLAIN_NAME.fullmatch(name) else escape(name, 64)


def explain_certificate(
    cert: x509.Certificate,
    *,
    host: str,
    server_name: str,
    ca: str,
    verify_code: int | None,
    now: datetime | None = None,
) -> str | None:
    """What is wrong with the coordinator's certificate ``cert`` for a client that dialled
    ``host`` (verifying ``server_name`` instead when given) and trusts the CA bundle ``ca``,
    with the fix; ``None`` when nothing is. ``verify_code``: OpenSSL's verdict on the chain
    and name (``None``: it passed)."""
    now = now or datetime.now(timezone.utc)
    what = f"its certificate ({_subject(cert)})"
    if cert.not_valid_after_utc < now:
        return f"{what} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: issue the coordinator a new one"
    if cert.not_valid_before_utc > now:
        return (
            f"{what} is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC: check the clocks of "
            "both machines"
        )
    if verify_code is None:
        return None
    if verify_code in _NAME_MISMATCH:
        return _name_mismatch(what, certificate_names(cert), host=host, server_name=server_name)
    if verify_code == 26:  # X509_V_ERR_INVALID_PURPOSE
        try:
            usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
            server = ExtendedKeyUsageOID.SERVER_AUTH in usages
        except x509.ExtensionNotFound:
            server = True
        if not server:
            return f"{what} is not a server certificate: issue it with `fedgrid certs issue NAME --server`"
    return (
        f"{what}, issued by {_issuer(cert)}, is not signed by a CA in --ca {ca}: give the CA bundle of "
        "the federation that issued the coordinator's certificate"
    )


def _name_mismatch(what: str, names: list[str], *, host: str, server_name: str) -> str:
    expected = server_name or host
    dns = [n for n in names if not _is_ip(n)]
    listed = ", ".join(names) if names else "none"
    if server_name:
        fix = f"give --server-name one of its names ({', '.join(dns) or listed})" if names else ""
    else:
        fix = (
            f"dial one of its names, or keep --coordinator {host} and add --server-name {dns[0]}"
            if dns
            else f"dial one of its addresses ({listed})"
        )
    reissue = f"or issue the coordinator a certificate with --san {expected}"
    return f"{what} holds the names {listed}, not {expected!r}: {fix + ', ' if fix else ''}{reissue}"


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _split(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


def _context(tls: TLSFiles | None, *, verify: bool, hostname: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = hostname
    ctx.verify_mode = ssl.CERT_REQUIRED if verify else ssl.CERT_NONE
    if tls is not None:
        if verify:
            ctx.load_verify_locations(cafile=tls.ca)
        ctx.load_cert_chain(tls.cert, tls.key)
    ctx.set_alpn_protocols(["h2"])  # gRPC's
    return ctx


def _handshake(
    target: str, ctx: ssl.SSLContext, name: str, timeout: float
) -> tuple[bytes | None, bool | None, int | None]:
    """One TLS handshake: (the peer's certificate, whether it then sent bytes, OpenSSL's verify
    code). Raises ``OSError`` (``ssl.SSLError`` included) when there is no handshake."""
    host, port = _split(target)
    with socket.create_connection((host, port), timeout=timeout) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname=name) as conn:
                der = conn.getpeercert(binary_form=True)
                try:
                    spoke = bool(conn.recv(1))  # a gRPC server sends its SETTINGS at once
                except (TimeoutError, socket.timeout):
                    spoke = None  # silent: nothing to tell
                except (ssl.SSLError, ConnectionError):
                    spoke = False
                return der, spoke, None
        except ssl.SSLCertVerificationError as exc:
            return None, None, exc.verify_code


def diagnose(
    target: str, tls: TLSFiles | None, server_name: str = "", *, timeout: float = PROBE_TIMEOUT_S
) -> str | None:
    """The problem, and its fix, that keeps a client with ``tls`` (``None``: plaintext) from
    ever connecting to ``target``; ``None`` when the failure may pass (see the module
    docstring). Never raises for a network failure."""
    host, _ = _split(target)
    try:
        if tls is None:
            der, _, _ = _handshake(target, _context(None, verify=False, hostname=False), host, timeout)
            if der is None:
                return None
            names = ", ".join(certificate_names(x509.load_der_x509_certificate(der))) or "none"
            return f"it requires mutual TLS (it presented a certificate for {names}): give --ca, --cert and --key"
        der, _, _ = _handshake(target, _context(tls, verify=False, hostname=False), host, timeout)
        if der is None:
            return None
        _, spoke, code = _handshake(
            target, _context(tls, verify=True, hostname=True), server_name or host, timeout
        )
    except ssl.SSLError as exc:
        if tls is not None and "WRONG_VERSION_NUMBER" in str(exc):
            return (
                "it serves plaintext, not TLS: drop --ca, --cert and --key, or start it with its certificate"
            )
        return None
    except (OSError, ValueError):
        return None  # not listening, unreachable, timed out: transient
    problem = explain_certificate(
        x509.load_der_x509_certificate(der), host=host, server_name=server_name, ca=tls.ca, verify_code=code
    )
    if problem is None and spoke is False:
        return (
            f"it closes the connection after the handshake: it does not accept this client's certificate "
            f"({_subject(x509.load_pem_x509_certificate(Path(tls.cert).read_bytes()))}, --cert {tls.cert}): "
            "not signed by a CA the coordinator trusts (its --ca), or not a client certificate"
        )
    return problem
