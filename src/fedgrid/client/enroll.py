"""A device's half of enrollment: from a one-time token to the certificate it joins with.

``enroll`` makes the device's key here (it never leaves the device), sends a CSR and the
token to the coordinator's enrollment service (``fedgrid.v1.Enrollment``, server-authenticated
TLS: the service's certificate must be signed by the CA bundle the device was given, so the
token goes to no one else), checks the certificate that comes back and keeps it. From then on
the device is an ordinary mutual-TLS client: ``fedgrid.client.run_client(..., ca=, cert=, key=)``.

Enrolling is a provisioning step, kept apart from ``run_client`` (the SDK's two steps are
``enroll(...)`` then ``run_client(...)``; ``fedgrid client --enroll`` does both): it writes the key
and certificate files, and its failures (a spent or revoked token) are for an operator to
fix, never to retry. It is idempotent across restarts: when the certificate and key are
already there and valid, nothing is sent, so a restarted device keeps its identity.

Files: the key is written first, with mode 0600 from its creation, before the CSR leaves;
the certificate is written atomically once it checks out. A key without a certificate (an
enrollment interrupted after the key was written) is reused by the next try, so a device
that lost its network in the middle enrolls with the same key once it is back.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import grpc
import tenacity

from fedgrid.client.runtime import RpcFailed
from fedgrid.constants import ENROLL_TIMEOUT_S, RETRY_MAX_ELAPSED_S, RETRY_MAX_WAIT_S
from fedgrid.errors import PKIError
from fedgrid.pki import check_identity, identity_of, load_pem_files, make_csr, write_atomic
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc

__all__ = ["enroll", "default_name", "RETRIED"]

log = logging.getLogger(__name__)

#: Statuses that mean the service did not spend the token (unreachable; at its limit of
#: enrollments at once): retried with backoff. Any other refusal is final.
RETRIED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


def default_name(token: str) -> str:
    """The identity a device asks for when given no name: ``client-<token id>``, unique per
    token. A token issued for a name (``fedgrid certs token --name``) needs that name instead.

    Raises:
        ValueError: ``token`` is not ``<token_id>.<secret>``.
    """
    token_id, dot, secret = token.strip().partition(".")
    if not dot or not token_id or not secret:
        raise ValueError("enrollment token: expected <token_id>.<secret>, as `fedgrid certs token` prints it")
    return check_identity(f"client-{token_id}")


def _existing_identity(ca: str, cert: Path, key: Path, name: str | None) -> str | None:
    """The identity of an enrollment done before, ``None`` when there is none to keep."""
    if not cert.exists():
        return None  # a lone key is an interrupted enrollment's: reused below
    if not key.exists():
        raise PKIError(f"{cert} exists but its key {key} does not; remove {cert} to enroll again")
    try:
        load_pem_files(ca, cert, key)
        identity = identity_of(cert.read_bytes())
    except ValueError as exc:  # PKIError is one
        raise PKIError(
            f"{cert} and {key} exist but are not a valid client identity of {ca} ({exc}); "
            "remove both to enroll again with a new token"
        ) from None
    if name is not None and name != identity:
        raise PKIError(
            f"{cert} holds identity {identity!r}, not {name!r}; remove {cert} and {key} to enroll as {name!r}"
        )
    return identity


def _request(
    address: str,
    request: pb.EnrollRequest,
    ca_pem: bytes,
    *,
    server_name: str,
    timeout: float,
    retry_max_elapsed: float,
) -> pb.EnrollReply:
    options: list[tuple[str, int | str]] = [
        ("grpc.max_receive_message_length", 64 * 1024),
        ("grpc.use_local_subchannel_pool", 1),
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(lambda e: isinstance(e, grpc.RpcError) and e.code() in RETRIED),
        wait=tenacity.wait_random_exponential(multiplier=0.2, max=RETRY_MAX_WAIT_S),
        stop=tenacity.stop_after_delay(retry_max_elapsed),
        before_sleep=lambda rs: log.info(
            "retrying enrollment: %s", rs.outcome.exception() if rs.outcome else ""
        ),
        reraise=True,
    )
    with grpc.secure_channel(
        address, grpc.ssl_channel_credentials(root_certificates=ca_pem), options=options
    ) as channel:
        stub = pb_grpc.EnrollmentStub(channel)
        try:
            return retrying(lambda: stub.Enroll(request, timeout=timeout))
        except grpc.RpcError as exc:
            raise RpcFailed("Enroll", exc.code(), exc.details() or "") from exc


def enroll(
    address: str,
    token: str,
    *,
    ca: str | os.PathLike[str],
    cert: str | os.PathLike[str],
    key: str | os.PathLike[str],
    server_name: str = "",
    name: str | None = None,
    timeout: float = ENROLL_TIMEOUT_S,
    retry_max_elapsed: float = RETRY_MAX_ELAPSED_S,
) -> str:
    """Enrolls this device once and returns its identity; a no-op when ``cert`` and ``key``
    already hold a valid client identity of ``ca``.

    Args:
        address: ``HOST:PORT`` of the coordinator's enrollment service (its ``enroll_listen``).
        token: the one-time token of ``fedgrid certs token``.
        ca: the CA bundle: it must sign the service's certificate and the certificate issued.
        cert: where the certificate is written (mode 0644).
        key: where the key is written (mode 0600, created so, before the CSR is sent).
        server_name: the name the service's certificate holds, when not the host of ``address``.
        name: the identity asked for; default ``default_name(token)``. A token issued for a
            name enrolls only that name.
        timeout: deadline of one enrollment call, seconds.
        retry_max_elapsed: how long an unreachable or busy service is retried.
    Returns:
        The identity: the certificate's common name, the client's name to the coordinator.
    Raises:
        ValueError: a malformed token or an invalid ``name`` (nothing written).
        PKIError: existing files that are not a valid identity (or of another name); an
            unreadable CA bundle; a certificate that came back but does not check out (not
            signed by ``ca``, not for this key, not a client certificate of ``name``).
        RpcFailed: the service refused: UNAUTHENTICATED (token unknown, used, expired or
            revoked), INVALID_ARGUMENT (CSR), PERMISSION_DENIED (name not the token's, or
            taken); or it stayed unreachable. The key stays for the next try.
    """
    cert_path, key_path = Path(cert), Path(key)
    existing = _existing_identity(str(ca), cert_path, key_path, name)
    if existing is not None:
        log.info("enrollment skipped: %s already holds identity %r", cert_path, existing)
        return existing
    identity = check_identity(name) if name is not None else default_name(token)
    ca_pem = _read_ca(ca)
    csr_pem = _key_and_csr(identity, key_path)
    reply = _request(
        address,
        pb.EnrollRequest(token=token.strip(), csr_pem=csr_pem),
        ca_pem,
        server_name=server_name,
        timeout=timeout,
        retry_max_elapsed=retry_max_elapsed,
    )
    _install_certificate(
        reply, address=address, ca=ca, cert_path=cert_path, key_path=key_path, identity=identity
    )
    log.info("enrolled as %r: certificate %s, key %s", identity, cert_path, key_path)
    return identity


def _read_ca(ca: str | os.PathLike[str]) -> bytes:
    """The CA bundle in file ``ca``, read before any key is made.

    Raises:
        PKIError: the file is not readable (named).
    """
    try:
        return Path(ca).read_bytes()
    except OSError as exc:
        raise PKIError(f"{ca}: CA bundle not readable ({exc.strerror})") from None


def _key_and_csr(identity: str, key_path: Path) -> bytes:
    """A CSR of ``identity`` for the key in ``key_path``: the one an earlier enrollment left
    there, else a new one, written (mode 0600) before the CSR leaves.

    Raises:
        PKIError: ``key_path`` holds no usable key.
    """
    old_key = key_path.read_bytes() if key_path.exists() else None
    try:
        key_pem, csr_pem = make_csr(identity, key_pem=old_key)
    except ValueError as exc:
        raise PKIError(f"{key_path}: {exc}; remove it to enroll with a new key") from None
    if old_key is None:
        key_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(
            key_path, key_pem, 0o600
        )  # on disk before the CSR leaves: no certificate without its key
    else:
        log.info("enrolling with the key an earlier enrollment left in %s", key_path)
    return csr_pem


def _install_certificate(
    reply: pb.EnrollReply,
    *,
    address: str,
    ca: str | os.PathLike[str],
    cert_path: Path,
    key_path: Path,
    identity: str,
) -> None:
    """Writes the certificate of ``reply`` to ``cert_path`` once it checks out: signed by
    ``ca``, for the key in ``key_path``, valid now, a client certificate of ``identity``.

    Raises:
        PKIError: it does not check out (``cert_path`` is then left as it was).
    """
    staged = cert_path.with_name(f".{cert_path.name}.enrolling")
    cert_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_atomic(staged, reply.certificate_pem, 0o644)
    try:
        load_pem_files(ca, staged, key_path)  # signed by ca, for this key, valid now
        got = identity_of(reply.certificate_pem)  # a client certificate (clientAuth) and its name
        if got != identity or reply.identity != identity:
            raise PKIError(
                f"the enrollment service returned a certificate of {got!r} (reply names {reply.identity[:128]!r}), "
                f"not of {identity!r}"
            )
        # Written again, not renamed: write_atomic also makes the rename durable, so the
        # certificate the token paid for survives a power cut.
        write_atomic(cert_path, reply.certificate_pem, 0o644)
    except ValueError as exc:
        raise PKIError(
            f"the certificate the enrollment service at {address} returned does not check out: {exc}"
        ) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            staged.unlink()
