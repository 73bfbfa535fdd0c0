"""Who is calling: the peer's certificate identity and its session token, checked before
any servicer code runs.

``server/service.py: guard`` wraps every method handler of the service with ``PeerCheck``. Under mutual TLS the TLS stack has
already refused a peer without a valid certificate of the CA; the guard reads the
verified certificate from the call's auth context and refuses, with the servicer never
called:

- a revoked certificate (the revocation list is re-read when its file changes): UNAUTHENTICATED;
- a certificate that is not a client certificate of a valid identity (no clientAuth
  extended key usage, no or a malformed common name): PERMISSION_DENIED.

It then hands the servicer a ``Caller``: the certificate's identity (``None`` on a
plaintext coordinator) and the session token from the call's metadata
(``SESSION_METADATA_KEY``), so the token never travels in a message body. The transfer
handlers check that token (``Membership.session``) before a download or upload counts
anywhere (``server/slots.py``): a stream without a valid session holds nothing.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from dataclasses import dataclass

import grpc

from fedgrid.errors import AuthenticationError, PermissionDeniedError
from fedgrid.pki import RevocationList, identity_of, serial_of
from fedgrid.proto.tls import SESSION_METADATA_KEY

__all__ = ["Caller", "PeerCheck", "CALLER"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    """The verified peer of one call."""

    identity: str | None  # the client certificate's identity; None without TLS
    token: str  # the session token of its metadata ("" when it sent none)


#: The caller of the call being served (set by ``guard`` in the call's task).
CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("fedgrid_caller")


@functools.lru_cache(maxsize=4096)
def _parse(pem: bytes) -> tuple[str, int]:
    """(identity, serial) of a verified peer certificate: parsed once per certificate."""
    return identity_of(pem), serial_of(pem)


class PeerCheck:
    """Checks each call's peer.

    Args:
        tls: whether the server requires client certificates (else every peer is anonymous).
        revocations: the CA's revocation list, or ``None``.
    """

    def __init__(self, *, tls: bool, revocations: RevocationList | None = None) -> None:
        self.tls = tls
        self.revocations = revocations

    def caller(self, context: grpc.aio.ServicerContext) -> Caller:
        token = ""
        for key, value in context.invocation_metadata() or ():
            if key == SESSION_METADATA_KEY:
                token = value if isinstance(value, str) else value.decode("ascii", "replace")
        if not self.tls:
            return Caller(None, token)
        pems = (context.auth_context() or {}).get("x509_pem_cert") or []
        if not pems:  # require_client_auth makes this unreachable; refuse rather than trust
            raise AuthenticationError("no client certificate")
        try:
            identity, serial = _parse(bytes(pems[0]))
        except ValueError as exc:
            raise PermissionDeniedError(f"not a client certificate: {exc}") from None
        if self.revocations is not None and self.revocations.is_revoked(serial):
            raise AuthenticationError(f"the certificate of {identity!r} (serial {serial:x}) is revoked")
        return Caller(identity, token)
