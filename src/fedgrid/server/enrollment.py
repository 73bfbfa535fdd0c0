"""The enrollment service: a device without a certificate trades a one-time token and a CSR
for a client certificate of the coordinator's CA (``fedgrid.v1.Enrollment``).

It listens on an address of its own because the coordinator's port requires a client
certificate at the handshake, which an enrolling device does not have yet. Its TLS
authenticates only the server (the coordinator's own certificate): the device checks it
against its CA bundle before sending the token, so nobody on the path reads the token or
hands the device a certificate of another CA. It never serves plaintext.

What a peer without a certificate can make it do is bounded: a message of at most
``ENROLL_MAX_MESSAGE_BYTES`` (a CSR is under 2 KiB), ``ENROLL_MAX_CONCURRENT`` enrollments at
once (more get RESOURCE_EXHAUSTED), each answered within ``ENROLL_TIMEOUT_S``. The signing
itself is ``fedgrid.pki.enroll`` (token checked and spent under the certificate directory's
lock), run on a thread of its own so the event loop never waits on the lock or the disk.

Refusals name the problem: UNAUTHENTICATED for a token that is unknown, used, expired or
revoked; INVALID_ARGUMENT for a CSR that does not parse, is badly signed or asks for an
invalid name; PERMISSION_DENIED for a name the token may not enroll or one that already has
a valid certificate. Only a successful enrollment spends the token. Client-supplied text
(the token's id, the peer, the CSR's name inside pki's messages) reaches the log escaped
and cut short; the token's secret is never logged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fedgrid import pki
from fedgrid.constants import ENROLL_MAX_CONCURRENT, ENROLL_MAX_MESSAGE_BYTES, ENROLL_TIMEOUT_S
from fedgrid.errors import ConfigError, CSRError, EnrollmentError, EnrollmentNameError
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto.tls import TLSFiles
from fedgrid.server.aio import LoopThread, advertised_address, decoding
from fedgrid.textsafe import escape

__all__ = ["ENROLLMENT_SERVICE", "EnrollmentServer", "EnrollmentServicer", "STATUS_OF"]

log = logging.getLogger(__name__)

ENROLLMENT_SERVICE = "fedgrid.v1.Enrollment"

#: Most specific first: both subclasses are ``EnrollmentError``s.
STATUS_OF: tuple[tuple[type[EnrollmentError], grpc.StatusCode], ...] = (
    (CSRError, grpc.StatusCode.INVALID_ARGUMENT),
    (EnrollmentNameError, grpc.StatusCode.PERMISSION_DENIED),
    (EnrollmentError, grpc.StatusCode.UNAUTHENTICATED),
)
#: Characters of a refusal's message sent back (pki quotes the CSR's name, up to the message cap).
MAX_DETAIL_CHARS = 300

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", ENROLL_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", 64 * 1024),  # a certificate is about 1 KiB
    ("grpc.so_reuseport", 0),
    # A device makes one call; a connection holding more streams is not a device enrolling.
    ("grpc.max_concurrent_streams", 4),
    ("grpc.max_connection_idle_ms", 30_000),
    ("grpc.max_connection_age_ms", 120_000),
]


def _clip(text: str) -> str:
    return text if len(text) <= MAX_DETAIL_CHARS else text[:MAX_DETAIL_CHARS] + "..."


class _Late(Exception):
    """The enrollment's deadline passed before its thread got to it: nothing was signed."""


class EnrollmentServicer:
    """``fedgrid.v1.Enrollment``: decode, sign on the executor, map errors to status codes.

    Args:
        ca_dir: the certificate directory (``ca.key`` and ``tokens.json``).
        executor: threads for ``pki.enroll``; as many as ``max_concurrent``.
        max_concurrent: enrollments in flight at once; more are refused (RESOURCE_EXHAUSTED).
        timeout_s: an enrollment not signed by then is answered DEADLINE_EXCEEDED.
        days: validity of the certificates, clipped to the CA's.
    """

    def __init__(
        self, ca_dir: Path, executor: ThreadPoolExecutor, *, max_concurrent: int, timeout_s: float, days: int
    ) -> None:
        self.ca_dir, self.executor = ca_dir, executor
        self.max_concurrent, self.timeout_s, self.days = max_concurrent, timeout_s, days
        #: Enrollments whose signing thread has not returned yet (changed on the loop only).
        self.in_flight = 0

    def _enroll(self, token: str, csr_pem: bytes, deadline: float) -> tuple[bytes, str]:
        # A request that waited past its deadline for a thread is not signed: its caller is
        # gone and would never see the certificate its token paid for.
        if time.monotonic() >= deadline:
            raise _Late()
        return pki.enroll(self.ca_dir, token, csr_pem, days=self.days)

    def _finished(self, job: "asyncio.Future[tuple[bytes, str]]") -> None:
        self.in_flight -= 1
        if not job.cancelled():
            job.exception()  # retrieved: a late failure is logged by Enroll, not as "never retrieved"

    async def Enroll(self, request: pb.EnrollRequest, context: grpc.aio.ServicerContext) -> pb.EnrollReply:
        peer = escape(context.peer() or "", 64)
        token_id = escape(request.token.partition(".")[0], 32)  # never the secret
        if self.in_flight >= self.max_concurrent:
            log.warning(
                "enrollment of token %s from %s refused: %d in progress", token_id, peer, self.in_flight
            )
            await _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"enrollment: {self.in_flight} enrollments in progress, the most this coordinator signs at once; retry shortly",
            )
        remaining = context.time_remaining()
        timeout = self.timeout_s if remaining is None else max(0.0, min(self.timeout_s, remaining))
        self.in_flight += 1
        job = asyncio.get_running_loop().run_in_executor(
            self.executor, self._enroll, request.token, bytes(request.csr_pem), time.monotonic() + timeout
        )
        job.add_done_callback(self._finished)  # the count follows the thread, not the call
        try:
            cert, name = await asyncio.wait_for(asyncio.shield(job), timeout)
        except (asyncio.TimeoutError, _Late):
            log.warning("enrollment of token %s from %s not signed within %.1fs", token_id, peer, timeout)
            await _abort(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"enrollment: not signed within {timeout:.1f}s (the certificate directory is busy); if the token "
                "now reads as used, the certificate was issued: revoke the name and issue a new token",
            )
        except EnrollmentError as exc:
            code = next(c for kind, c in STATUS_OF if isinstance(exc, kind))
            log.info(
                "enrollment of token %s from %s refused (%s): %s",
                token_id,
                peer,
                code.name,
                escape(str(exc), 300),
            )
            await _abort(context, code, _clip(str(exc)))
        except Exception:
            log.exception("enrollment of token %s from %s failed", token_id, peer)
            await _abort(
                context, grpc.StatusCode.INTERNAL, "enrollment failed on the coordinator; its log says why"
            )
        log.info("enrolled %r (token %s) from %s", name, token_id, peer)
        return pb.EnrollReply(certificate_pem=cert, identity=name)


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    await context.abort(code, details)
    raise AssertionError("unreachable: context.abort raises")


def _der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def _credentials(tls: TLSFiles, ca_dir: Path) -> grpc.ServerCredentials:
    """Server-only TLS credentials from the coordinator's own certificate, once the
    certificate directory is known to be able to sign what the coordinator accepts."""
    try:
        ca, cert, key = tls.load()
    except (OSError, ValueError) as exc:
        raise ConfigError("cert", str(exc)) from None
    ca_cert_path, ca_key_path = ca_dir / pki.CA_CERT, ca_dir / pki.CA_KEY
    try:
        own = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            "enroll_dir",
            f"{ca_cert_path}: no readable CA certificate ({exc}); is {ca_dir} a "
            "certificate directory (fedgrid certs init)?",
        ) from None
    if not os.access(ca_key_path, os.R_OK):
        raise ConfigError(
            "enroll_dir", f"{ca_key_path}: the CA key is missing or unreadable; enrollment signs with it"
        )
    if _der(own) not in {_der(c) for c in x509.load_pem_x509_certificates(ca)}:
        # The devices verify their new certificate against this bundle and the coordinator's
        # handshake checks it: a certificate of any other CA would be useless to them.
        raise ConfigError(
            "enroll_dir",
            f"the CA of {ca_dir} ({own.subject.rfc4514_string()}) is not in {tls.ca}, the CA "
            "bundle the coordinator accepts clients of: enrolled certificates could not join",
        )
    if not tls.crl:
        log.warning(
            "enrollment without a revocation list (crl): an enrolled client cannot be revoked; give crl = %s",
            ca_dir / pki.CRL,
        )
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=None, require_client_auth=False)


class EnrollmentServer:
    """The enrollment service listening on its own address, on its own event-loop thread;
    ``address`` is known once constructed, ``start`` serves.

    Args:
        listen: ``HOST:PORT``; port 0 binds a free port.
        ca_dir: the certificate directory whose CA signs (``ca.pem``, ``ca.key``, ``tokens.json``).
        tls: the coordinator's TLS files. Only ``cert`` and ``key`` are presented (server
            authentication only); ``ca`` must contain the CA of ``ca_dir``.
        max_concurrent: enrollments in flight at once.
        timeout_s: deadline of one enrollment on the server.
        days: validity of the certificates issued.

    Raises:
        ConfigError: no TLS files (enrollment over plaintext would hand a certificate, and the
            token, to whoever is on the path); unreadable TLS files; ``ca_dir`` holds no CA, its
            key is unreadable, or its CA is not in ``tls.ca``.
        OSError: ``listen`` cannot be bound.
    """

    def __init__(
        self,
        listen: str,
        *,
        ca_dir: str | os.PathLike[str],
        tls: TLSFiles | None,
        max_concurrent: int = ENROLL_MAX_CONCURRENT,
        timeout_s: float = ENROLL_TIMEOUT_S,
        days: int = 365,
    ) -> None:
        if tls is None:
            raise ConfigError(
                "enroll_listen",
                "the enrollment service serves TLS only: over plaintext anyone on the path "
                "reads the token and can hand the device a certificate of its own; give ca, cert and key",
            )
        if max_concurrent < 1 or not timeout_s > 0:
            raise ValueError(
                f"max_concurrent must be at least 1 and timeout_s positive, got {max_concurrent} and {timeout_s}"
            )
        credentials = _credentials(tls, Path(ca_dir))
        self.executor = ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="fedgrid-enroll")
        self.servicer = EnrollmentServicer(
            Path(ca_dir), self.executor, max_concurrent=max_concurrent, timeout_s=timeout_s, days=days
        )
        self._aio = LoopThread("fedgrid-enroll-aio")

        async def build() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server(options=GRPC_OPTIONS)
            enroll = grpc.unary_unary_rpc_method_handler(
                decoding(self.servicer.Enroll, pb.EnrollRequest),
                request_deserializer=None,  # decoded by ``decoding``: junk is INVALID_ARGUMENT
                response_serializer=pb.EnrollReply.SerializeToString,
            )
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler("fedgrid.v1.Enrollment", {"Enroll": enroll}),)
            )
            return server, server.add_secure_port(listen, credentials)

        try:
            self.server, self.port = self._aio.run(build())
        except Exception:
            self._close()
            raise
        if self.port == 0:
            self._close()
            raise OSError(f"could not bind {listen} for enrollment")
        self.address = advertised_address(listen, self.port)

    def start(self) -> "EnrollmentServer":
        self._aio.run(self.server.start())
        log.info("enrollment service on %s: one-time tokens for client certificates", self.address)
        return self

    def stop(self, grace: float = 2.0) -> None:
        """Stops accepting; enrollments in flight get ``grace`` seconds to finish."""
        if not self._aio.alive:
            return
        try:
            self._aio.run(self.server.stop(grace), timeout=grace + 5.0)
        finally:
            self._close()

    def _close(self) -> None:
        self._aio.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
