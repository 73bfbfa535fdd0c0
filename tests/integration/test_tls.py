"""Mutual TLS on loopback with certificates made by ``fedgrid.pki``: each bad connection is
refused before any servicer code runs, the client's identity is its certificate's, and a
coordinator refuses open plaintext off loopback.

A "hostile" client here is a bare grpcio channel with credentials built from raw bytes: the
SDK checks its own files first (``fedgrid.trust.load_pem_files``) and would refuse these
certificates before connecting, so only a raw client reaches the coordinator's handshake.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedgrid.client.runtime import Connection, MisconfiguredConnection, RpcFailed
from fedgrid.errors import ConfigError
from fedgrid.ops import pki
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc
from fedgrid.proto.tls import TLSFiles, session_metadata
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.types import FitIns

from harness import wait_until
from harness_clients import Named


def _files(d: Path, name: str, ca: Path | None = None) -> TLSFiles:
    return TLSFiles(str((ca or d) / "ca.pem"), str(d / f"{name}.pem"), str(d / f"{name}.key"))


def _crafted(
    d: Path, name: str, *, not_before: datetime, not_after: datetime, eku=ExtendedKeyUsageOID.CLIENT_AUTH
) -> None:
    """A leaf signed by the CA of ``d`` with the given validity (what ``pki.issue`` never makes)."""
    ca = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


@pytest.fixture(scope="module")
def pki_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    pki.init_ca(d)
    pki.issue(d, "coordinator", server=True)  # SANs localhost, 127.0.0.1
    pki.issue(d, "elsewhere", server=True, sans=["elsewhere.example"])
    for name in ("alice", "bob", "carol"):
        pki.issue(d, name)
    now = datetime.now(timezone.utc)
    _crafted(d, "expired", not_before=now - timedelta(days=10), not_after=now - timedelta(days=1))
    _crafted(d, "early", not_before=now + timedelta(days=1), not_after=now + timedelta(days=10))
    other = d / "other"
    pki.init_ca(other)
    pki.issue(other, "mallory")
    return d


class Spy:
    """Counts the fleet calls the servicer makes: a refused peer must cause none."""

    METHODS = ("join", "poll_async", "heartbeat", "download", "upload", "leave")

    def __init__(self, fleet: RemoteFleet) -> None:
        self.calls: list[str] = []
        for name in self.METHODS:
            original = getattr(fleet, name)

            def wrapped(*args, _name=name, _original=original, **kwargs):
                self.calls.append(_name)
                return _original(*args, **kwargs)

            setattr(fleet, name, wrapped)


@pytest.fixture
def server(pki_dir):
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    spy = Spy(fleet)
    files = TLSFiles(
        str(pki_dir / "ca.pem"),
        str(pki_dir / "coordinator.pem"),
        str(pki_dir / "coordinator.key"),
        str(pki_dir / "crl.pem"),
    )
    coordinator = Coordinator("127.0.0.1:0", fleet, max_workers=4, tls=files).start()
    yield fleet, coordinator, spy
    coordinator.stop(grace=0.5)
    fleet.close()


def _raw_join(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.RpcError:
    channel = (
        grpc.secure_channel(address, credentials)
        if credentials is not None
        else grpc.insecure_channel(address)
    )
    try:
        pb_grpc.CoordinatorStub(channel).Join(pb.JoinRequest(num_examples=3), timeout=5)
    except grpc.RpcError as exc:
        return exc
    finally:
        channel.close()
    raise AssertionError("the coordinator accepted the connection")


def _creds(d: Path, name: str, ca: Path | None = None) -> grpc.ChannelCredentials:
    ca_dir = ca or d
    return grpc.ssl_channel_credentials(
        (ca_dir / "ca.pem").read_bytes(), (d / f"{name}.key").read_bytes(), (d / f"{name}.pem").read_bytes()
    )


def test_an_admitted_client_trains_under_its_certificate_identity(server, pki_dir, small_state):
    fleet, coordinator, spy = server
    conn = Connection(coordinator.address, tls=_files(pki_dir, "alice"))
    try:
        conn.join(Named("digits-0/3"))  # the SDK sends no name of its own under mTLS
        [info] = fleet.wait_for_clients(min_clients=1, timeout=timedelta(seconds=10))
        assert info.name == "alice" and conn.name == "alice"
        outcome: list = []
        rnd = threading.Thread(
            target=lambda: outcome.append(
                fleet.fit_round(
                    server_round=1,
                    global_state=small_state,
                    assignments=[(info, FitIns(round=1))],
                    timeout=timedelta(seconds=30),
                )
            )
        )
        rnd.start()
        task = conn.poll(10).task
        state = conn.download(task.task_id)
        update = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
        assert conn.upload(task.task_id, task.round, update, 3, {}) > 0
        rnd.join(30)
        [result] = outcome[0].results
        assert result.client.name == "alice"
        assert torch.equal(result.state["layer.weight"], small_state["layer.weight"] + 1)
    finally:
        conn.close()


@pytest.mark.parametrize(
    "case",
    [
        "plaintext",
        "wrong CA",
        "expired",
        "not yet valid",
        "server certificate as client's",
        "no client certificate",
    ],
)
def test_a_bad_connection_is_refused_at_the_handshake(server, pki_dir, case):
    fleet, coordinator, spy = server
    credentials = {
        "plaintext": None,
        "wrong CA": _creds(pki_dir / "other", "mallory", ca=pki_dir),
        "expired": _creds(pki_dir, "expired"),
        "not yet valid": _creds(pki_dir, "early"),
        "server certificate as client's": _creds(pki_dir, "coordinator"),
        "no client certificate": grpc.ssl_channel_credentials((pki_dir / "ca.pem").read_bytes()),
    }[case]
    err = _raw_join(coordinator.address, credentials)
    assert err.code() == grpc.StatusCode.UNAVAILABLE  # no connection came up
    assert spy.calls == [] and fleet.membership.records == {}  # the servicer saw nothing


@pytest.mark.parametrize("case", ["wrong host name", "client certificate as server's"])
def test_the_client_refuses_a_coordinator_with_the_wrong_certificate(pki_dir, case):
    name = {"wrong host name": "elsewhere", "client certificate as server's": "bob"}[case]
    fleet = RemoteFleet()
    coordinator = Coordinator("127.0.0.1:0", fleet, tls=_files(pki_dir, name)).start()
    try:
        conn = Connection(
            coordinator.address, tls=_files(pki_dir, "alice"), retry_max_elapsed=0.5, rpc_timeout=5
        )
        with pytest.raises(MisconfiguredConnection) as err:
            conn.join(Named("x"))
        conn.close()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        words = {
            "wrong host name": "holds the names elsewhere.example, not '127.0.0.1'",
            "client certificate as server's": "(CN=bob) is not a server certificate",
        }[case]
        assert words in str(err.value)  # the SDK names what is wrong with the certificate
        assert fleet.membership.records == {}
    finally:
        coordinator.stop(grace=0.5)
        fleet.close()


def test_a_revoked_certificate_is_refused_before_the_servicer_once_the_list_changes(pki_dir, tmp_path):
    d = tmp_path / "ca"
    pki.init_ca(d)
    pki.issue(d, "coordinator", server=True)
    pki.issue(d, "dave")
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    files = TLSFiles(
        str(d / "ca.pem"), str(d / "coordinator.pem"), str(d / "coordinator.key"), str(d / "crl.pem")
    )
    coordinator = Coordinator("127.0.0.1:0", fleet, tls=files).start()
    try:
        conn = Connection(coordinator.address, tls=_files(d, "dave"))
        conn.join(Named("dave"))
        assert conn.heartbeat() > 0
        spy = Spy(fleet)
        pki.revoke(d, "dave")  # rewrites crl.pem; the coordinator re-reads it when it changes

        def refused() -> bool:
            before = len(spy.calls)
            try:
                conn.stub.Heartbeat(
                    pb.HeartbeatRequest(client_id=conn.client_id),
                    metadata=session_metadata(conn.token),
                    timeout=5,
                )
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED and "is revoked" in exc.details(), (
                    exc.details()
                )
                assert len(spy.calls) == before  # the refused call never reached the fleet
                return True
            return False

        wait_until(refused, timeout=15, what="the revoked certificate refused")
        spy.calls.clear()
        assert _raw_join(coordinator.address, _creds(d, "dave")).code() == grpc.StatusCode.UNAUTHENTICATED
        assert spy.calls == []
        conn.close()
    finally:
        coordinator.stop(grace=0.5)
        fleet.close()


def test_identity_binds_the_session(server, pki_dir):
    fleet, coordinator, spy = server
    alice = grpc.secure_channel(coordinator.address, _creds(pki_dir, "alice"))
    bob = grpc.secure_channel(coordinator.address, _creds(pki_dir, "bob"))
    try:
        a, b = pb_grpc.CoordinatorStub(alice), pb_grpc.CoordinatorStub(bob)
        # A certificate cannot join under another name.
        with pytest.raises(grpc.RpcError) as err:
            a.Join(pb.JoinRequest(name="bob", num_examples=3), timeout=5)
        assert (
            err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            and "cannot join as 'bob'" in err.value.details()
        )
        assert fleet.membership.records == {}
        first = a.Join(pb.JoinRequest(num_examples=3), timeout=5)
        joined_b = b.Join(pb.JoinRequest(name="bob", num_examples=3), timeout=5)  # its own name is fine
        # Bob's session presented over Alice's certificate is refused, though the token is right.
        with pytest.raises(grpc.RpcError) as err:
            a.Heartbeat(
                pb.HeartbeatRequest(client_id=joined_b.client_id),
                metadata=session_metadata(joined_b.session_token),
                timeout=5,
            )
        assert (
            err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            and "certificate of 'alice' cannot act" in err.value.details()
        )
        # No token in the metadata: refused (it is not read from the body any more).
        with pytest.raises(grpc.RpcError) as err:
            a.Heartbeat(pb.HeartbeatRequest(client_id=first.client_id), timeout=5)
        assert (
            err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "bad session token" in err.value.details()
        )
        # One identity, one live session: a second join replaces the first.
        second = a.Join(pb.JoinRequest(num_examples=3), timeout=5)
        names = sorted(r.info.name for r in fleet.membership.records.values())
        assert names == ["alice", "bob"] and first.client_id not in fleet.membership.records
        with pytest.raises(grpc.RpcError) as err:
            a.Heartbeat(
                pb.HeartbeatRequest(client_id=first.client_id),
                metadata=session_metadata(first.session_token),
                timeout=5,
            )
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (
            a.Heartbeat(
                pb.HeartbeatRequest(client_id=second.client_id),
                metadata=session_metadata(second.session_token),
                timeout=5,
            ).interval_s
            > 0
        )
    finally:
        alice.close()
        bob.close()


def test_plaintext_off_loopback_needs_insecure(caplog):
    fleet = RemoteFleet()
    with pytest.raises(ConfigError, match="not a loopback address.*--insecure"):
        Coordinator("0.0.0.0:0", fleet)
    with caplog.at_level(logging.WARNING, logger="fedgrid.server.serve"):
        coordinator = Coordinator("0.0.0.0:0", fleet, insecure=True).start()
    try:
        assert any(
            r.levelno == logging.WARNING and "INSECURE: plaintext" in r.getMessage() for r in caplog.records
        )
    finally:
        coordinator.stop(grace=0.5)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedgrid.server.serve"):
        coordinator = Coordinator("127.0.0.1:0", fleet).start()
    coordinator.stop(grace=0.5)
    assert any("plaintext on loopback" in r.getMessage() for r in caplog.records)
    fleet.close()


def test_the_sdk_says_why_a_tls_coordinator_closed_its_plaintext_connection(server):
    fleet, coordinator, spy = server
    conn = Connection(coordinator.address, retry_max_elapsed=0.5, rpc_timeout=5)
    with pytest.raises(RpcFailed) as err:
        conn.join(Named("plain"))
    conn.close()
    assert isinstance(err.value, MisconfiguredConnection) and err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "it requires mutual TLS (it presented a certificate for localhost, 127.0.0.1): give --ca" in str(
        err.value
    )
    assert spy.calls == []


def test_mismatched_tls_files_are_named_before_any_connection(pki_dir):
    fleet = RemoteFleet()
    wrong_key = TLSFiles(
        str(pki_dir / "ca.pem"), str(pki_dir / "coordinator.pem"), str(pki_dir / "alice.key")
    )
    with pytest.raises(ConfigError, match="alice.key"):
        Coordinator("127.0.0.1:0", fleet, tls=wrong_key)
    with pytest.raises(ValueError, match="expired"):
        Connection("127.0.0.1:1", tls=_files(pki_dir, "expired"))
    with pytest.raises(ValueError, match="missing key"):
        TLSFiles.from_options(str(pki_dir / "ca.pem"), str(pki_dir / "alice.pem"), "")
    fleet.close()
