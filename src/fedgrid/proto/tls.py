"""Transport security of the wire: mutual TLS credentials and where a session travels.

Both sides of ``fedgrid.v1`` build their gRPC credentials here from PEM files (made by
``fedgrid certs`` or any other PKI: ``fedgrid.pki.load_pem_files`` checks them first, so a
wrong file is named before a handshake fails). The coordinator requires a client
certificate signed by the CA (``require_client_auth``): a plaintext client, one without a
certificate, or one whose certificate is expired, not yet valid, of another CA or made for
a server (the TLS stack checks the extended key usage) fails the handshake, before any
servicer code runs. Revocation and identity are checked per call (``server/peers.py``),
since gRPC's Python API takes no revocation list.

A session token travels in call metadata under ``SESSION_METADATA_KEY``, never in a
message body: bodies are what gets logged, echoed in errors and stored.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Sequence

import grpc

from fedgrid.pki import load_pem_files

__all__ = [
    "SESSION_METADATA_KEY",
    "TLSFiles",
    "server_credentials",
    "channel_credentials",
    "is_loopback",
    "session_metadata",
]

#: The call-metadata key of a session token (gRPC keys are lowercase ASCII).
SESSION_METADATA_KEY = "fedgrid-session"


@dataclass(frozen=True)
class TLSFiles:
    """A side's PEM files: the CA bundle it trusts, its certificate and its private key.

    Args:
        ca: CA certificate(s) that sign the peer's certificate.
        cert: this side's certificate (a chain: leaf first).
        key: this side's private key (mode 0600).
        crl: coordinator only, optional: a PEM revocation list, re-read when it changes.
    """

    ca: str
    cert: str
    key: str
    crl: str = ""

    @staticmethod
    def from_options(ca: str, cert: str, key: str, crl: str = "", *, what: str = "TLS") -> "TLSFiles | None":
        """``None`` when none of ``ca``, ``cert``, ``key`` is given; all three or an error."""
        given = [name for name, value in (("ca", ca), ("cert", cert), ("key", key)) if value]
        if not given:
            if crl:
                raise ValueError(f"{what}: a revocation list (crl) needs ca, cert and key")
            return None
        if len(given) != 3:
            missing = [n for n in ("ca", "cert", "key") if n not in given]
            raise ValueError(f"{what}: ca, cert and key go together; missing {', '.join(missing)}")
        return TLSFiles(ca, cert, key, crl)

    def load(self) -> tuple[bytes, bytes, bytes]:
        """(CA bundle, certificate, key) as bytes, checked (``fedgrid.pki.load_pem_files``)."""
        return load_pem_files(self.ca, self.cert, self.key)


def server_credentials(files: TLSFiles) -> grpc.ServerCredentials:
    """Credentials of a coordinator that requires a client certificate of ``files.ca``."""
    ca, cert, key = files.load()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def channel_credentials(files: TLSFiles) -> grpc.ChannelCredentials:
    """Credentials of a client: it trusts ``files.ca`` and presents its certificate."""
    ca, cert, key = files.load()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (of a listen address) is reachable only from this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def session_metadata(token: str) -> Sequence[tuple[str, str]]:
    """The metadata a call of a session carries."""
    return ((SESSION_METADATA_KEY, token),)
