"""Connection errors sorted into permanent and transient, against real coordinators on port 0.

Permanent ones are raised at the first failure with their fix (a certificate whose SANs leave
out the address dialled, one of another CA, expired, TLS on one side only, a run that is
over), long before the 60 s connect deadline the client is given. Transient ones (a
coordinator gone) are retried, logged once per backoff step, until the give-up bound, and the
client then says what it waited for.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent import futures
from datetime import datetime, timedelta, timezone
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedgrid.client import CoordinatorLost, MisconfiguredConnection, RpcFailed
from fedgrid.client.runtime import Connection
from fedgrid.errors import RUN_FINISHED
from fedgrid.ops import pki
from fedgrid.proto.tls import TLSFiles
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator

from harness import InProcessCoordinator, wait_until
from harness_clients import Named

#: What the client is given: a permanent error must come long before it.
CONNECT_TIMEOUT_S = 60.0
AT_ONCE_S = 10.0


@pytest.fixture(scope="module")
def pki_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    pki.init_ca(d)
    pki.issue(d, "coordinator", server=True)  # SANs localhost, 127.0.0.1
    pki.issue(d, "remote", server=True, sans=["coord.example.org", "10.0.0.5"])  # the README's, not 127.0.0.1
    pki.issue(d, "alice")
    other = d / "other"
    pki.init_ca(other)
    pki.issue(other, "coordinator", server=True)
    pki.issue(other, "mallory")
    (d / "both-cas.pem").write_bytes((d / "ca.pem").read_bytes() + (other / "ca.pem").read_bytes())
    return d


def _files(d: Path, name: str, ca: Path | None = None) -> TLSFiles:
    return TLSFiles(str(ca or d / "ca.pem"), str(d / f"{name}.pem"), str(d / f"{name}.key"))


def _join_fails(address: str, tls: TLSFiles | None, server_name: str = "") -> tuple[RpcFailed, float]:
    conn = Connection(
        address, tls=tls, server_name=server_name, connect_timeout=CONNECT_TIMEOUT_S, rpc_timeout=5
    )
    started = time.monotonic()
    try:
        with pytest.raises(RpcFailed) as err:
            conn.join(Named("x"))
    finally:
        conn.close()
    return err.value, time.monotonic() - started


def _serve(tls: TLSFiles | None) -> tuple[Coordinator, RemoteFleet]:
    fleet = RemoteFleet()
    return Coordinator("127.0.0.1:0", fleet, tls=tls).start(), fleet


def test_a_san_mismatch_is_reported_at_once_with_the_names_and_server_name(pki_dir):
    coordinator, fleet = _serve(_files(pki_dir, "remote"))
    try:
        err, took = _join_fails(coordinator.address, _files(pki_dir, "alice"))
        assert isinstance(err, MisconfiguredConnection) and took < AT_ONCE_S
        assert str(err) == (
            f"cannot connect to the coordinator at {coordinator.address}: its certificate (CN=remote) holds "
            "the names coord.example.org, 10.0.0.5, not '127.0.0.1': dial one of its names, or keep "
            "--coordinator 127.0.0.1 and add --server-name coord.example.org, or issue the coordinator a "
            "certificate with --san 127.0.0.1"
        )
        # The fix it names works.
        conn = Connection(coordinator.address, tls=_files(pki_dir, "alice"), server_name="coord.example.org")
        conn.join(Named("x"))
        conn.close()
        assert [r.info.name for r in fleet.membership.records.values()] == ["alice"]
    finally:
        coordinator.stop(grace=0.2)
        fleet.close()


@pytest.mark.parametrize(
    "case, words",
    [
        (
            "unknown CA",
            "its certificate (CN=coordinator), issued by CN=fedgrid CA, is not signed by a CA in --ca",
        ),
        (
            "client refused",
            "it closes the connection after the handshake: it does not accept this client's certificate (CN=mallory",
        ),
        ("plaintext coordinator", "it serves plaintext, not TLS: drop --ca, --cert and --key"),
        ("plaintext client", "it requires mutual TLS (it presented a certificate for localhost, 127.0.0.1)"),
    ],
)
def test_a_tls_mismatch_is_reported_at_once_with_its_fix(pki_dir, case, words):
    other = pki_dir / "other"
    server_tls, client_tls = {
        "unknown CA": (_files(other, "coordinator"), _files(pki_dir, "alice")),
        "client refused": (
            _files(pki_dir, "coordinator"),
            _files(other, "mallory", ca=pki_dir / "both-cas.pem"),
        ),
        "plaintext coordinator": (None, _files(pki_dir, "alice")),
        "plaintext client": (_files(pki_dir, "coordinator"), None),
    }[case]
    coordinator, fleet = _serve(server_tls)
    try:
        err, took = _join_fails(coordinator.address, client_tls)
        assert isinstance(err, MisconfiguredConnection) and took < AT_ONCE_S, (err, took)
        assert words in str(err)
        assert fleet.membership.records == {}
    finally:
        coordinator.stop(grace=0.2)
        fleet.close()


def _expired_server_cert(d: Path) -> tuple[bytes, bytes]:
    """A server certificate of the CA of ``d`` that expired yesterday (``pki.issue`` never makes one)."""
    ca = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stale")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=30))
        .not_valid_after(now - timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return pem_key, cert.public_bytes(serialization.Encoding.PEM)


def test_an_expired_coordinator_certificate_is_reported_at_once(pki_dir):
    # fedgrid's coordinator refuses to start on an expired certificate: a bare gRPC server
    # stands for one whose certificate expired while it ran.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_secure_port(
        "127.0.0.1:0",
        grpc.ssl_server_credentials(
            [_expired_server_cert(pki_dir)],
            root_certificates=(pki_dir / "ca.pem").read_bytes(),
            require_client_auth=True,
        ),
    )
    server.start()
    try:
        err, took = _join_fails(f"127.0.0.1:{port}", _files(pki_dir, "alice"), server_name="localhost")
        assert isinstance(err, MisconfiguredConnection) and took < AT_ONCE_S
        assert "its certificate (CN=stale) expired on " in str(
            err
        ) and "issue the coordinator a new one" in str(err)
    finally:
        server.stop(grace=0)


def test_a_run_that_has_finished_is_reported_at_once(small_state):
    server = InProcessCoordinator(small_state)
    try:
        server.fleet.finish(timeout=timedelta(seconds=5))
        err, took = _join_fails(server.address, None)
        assert err.reason == RUN_FINISHED and took < AT_ONCE_S
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION
        assert f"the coordinator at {server.address} finished its run; start a new run to train again" in str(
            err
        )
    finally:
        server.stop()


def test_a_coordinator_that_never_returns_is_given_up_after_the_bound(caplog):
    server = InProcessCoordinator(OrderedDict())
    conn = Connection(server.address, retry_max_elapsed=3.0, retry_max_wait=0.2, rpc_timeout=2)
    try:
        conn.join(Named("site-a"))
        server.stop()  # gone for good: no --state-dir, no restart
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="fedgrid.client.connection"):
            with pytest.raises(CoordinatorLost) as err:
                conn.poll(wait_s=1.0)
        took = time.monotonic() - started
        assert 3.0 <= took < 3.0 + AT_ONCE_S
        assert str(err.value).startswith(
            f"gave up after 3s without an answer from the coordinator at {server.address} (--give-up-after-s), "
            "waiting for its next task (PollTask: UNAVAILABLE: "
        )
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        # Logged once per backoff step (the first failure, then each doubling of the time waited), not per try.
        # This coordinator's lines only: a client another test of this worker left polling its own
        # stopped coordinator logs through the same logger (CI once counted 5 lines from two ports).
        lines = [
            r.getMessage()
            for r in caplog.records
            if r.getMessage().startswith(f"PollTask on {server.address}:")
        ]
        assert lines[0].endswith("retrying for up to 3s")
        # At 1 s and 2 s; a loaded machine may log the first line late, and with it one more step.
        assert 3 <= len(lines) <= 4 and all(": still failing after " in line for line in lines[1:]), lines
        tries = int(lines[-1].split(" tries)")[0].rsplit("(", 1)[1])
        assert tries >= len(lines) + 2, lines  # several tries behind the lines
    finally:
        conn.close()


def test_a_stop_ends_the_backoff_between_tries_at_once(monkeypatch, caplog):
    """A client stopped while it waits between two tries leaves then, not after the wait (a
    region refused upstream sat out its backoff after its stop)."""
    import threading

    import tenacity

    monkeypatch.setattr(tenacity, "wait_random_exponential", lambda **_: tenacity.wait_fixed(60))
    server = InProcessCoordinator(OrderedDict())
    stop = threading.Event()
    conn = Connection(server.address, stop=stop, retry_max_elapsed=120.0, rpc_timeout=2)
    failed: list[BaseException] = []
    try:
        conn.join(Named("site-a"))
        server.stop()

        def poll() -> None:
            try:
                conn.poll(wait_s=1.0)
            except RpcFailed as exc:
                failed.append(exc)

        with caplog.at_level(logging.INFO, logger="fedgrid.client.connection"):
            thread = threading.Thread(target=poll)
            thread.start()
            wait_until(  # logged just before the 60 s wait
                lambda: any("retrying for up to 120s" in r.getMessage() for r in caplog.records),
                timeout=30,
                what="the first failure",
            )
            stopped = time.monotonic()
            stop.set()
            thread.join(timeout=30)
        assert not thread.is_alive() and time.monotonic() - stopped < 5.0, time.monotonic() - stopped
        assert len(failed) == 1 and failed[0].code == grpc.StatusCode.UNAVAILABLE
    finally:
        conn.close()
