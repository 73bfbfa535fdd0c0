"""Enrollment over real TLS on loopback: a device without a certificate trades a one-time token
for one (``server/enrollment.py``, ``client/enroll.py``) and then joins the mutual-TLS
coordinator under the token's identity. Certificates come from ``fedgrid.pki``.
"""

from __future__ import annotations

import fcntl
import os
import stat
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import fedgrid.pki as pki_kernel  # the kernel half: its clock and files serve both halves
from fedgrid.client.enroll import enroll
from fedgrid.client.runtime import Connection, RpcFailed
from fedgrid.constants import ENROLL_MAX_MESSAGE_BYTES
from fedgrid.errors import ConfigError, PKIError
from fedgrid.ops import pki
from fedgrid.pki_files import read_json
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc
from fedgrid.proto.tls import TLSFiles
from fedgrid.server.enrollment import EnrollmentServer
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator

import zygote
from harness import FEDGRID, THREADS, child_env, start_coordinator, wait_until
from harness_clients import Named


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    d = tmp_path / "pki"
    pki.init_ca(d)
    pki.issue(d, "coordinator", server=True)  # SANs localhost and 127.0.0.1
    return d


def server_tls(d: Path) -> TLSFiles:
    return TLSFiles(
        ca=str(d / "ca.pem"),
        cert=str(d / "coordinator.pem"),
        key=str(d / "coordinator.key"),
        crl=str(d / "crl.pem"),
    )


@pytest.fixture
def service(ca_dir: Path):
    server = EnrollmentServer("127.0.0.1:0", ca_dir=ca_dir, tls=server_tls(ca_dir)).start()
    yield server
    server.stop(grace=0.5)


@pytest.fixture
def coordinator(ca_dir: Path):
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    c = Coordinator("127.0.0.1:0", fleet, max_workers=8, tls=server_tls(ca_dir)).start()
    yield c
    c.stop(grace=0.5)
    fleet.close()


def device(tmp_path: Path, ca_dir: Path, which: str = "device") -> dict[str, str]:
    """A device's files: the CA bundle it was shipped with, and where its cert and key go."""
    home = tmp_path / which
    home.mkdir()
    (home / "ca.pem").write_bytes((ca_dir / "ca.pem").read_bytes())
    return {"ca": str(home / "ca.pem"), "cert": str(home / "client.pem"), "key": str(home / "client.key")}


def stub(service: EnrollmentServer, ca_dir: Path) -> tuple[grpc.Channel, pb_grpc.EnrollmentStub]:
    channel = grpc.secure_channel(
        service.address, grpc.ssl_channel_credentials(root_certificates=(ca_dir / "ca.pem").read_bytes())
    )
    return channel, pb_grpc.EnrollmentStub(channel)


def refusal(service: EnrollmentServer, ca_dir: Path, token: str, csr_pem: bytes) -> grpc.RpcError:
    channel, s = stub(service, ca_dir)
    with channel, pytest.raises(grpc.RpcError) as info:
        s.Enroll(pb.EnrollRequest(token=token, csr_pem=csr_pem), timeout=10)
    return info.value


def join_name(coordinator: Coordinator, files: dict[str, str]) -> str:
    """Joins over mutual TLS with ``files`` and returns the name the membership holds for it."""
    conn = Connection(
        coordinator.address, tls=TLSFiles(files["ca"], files["cert"], files["key"]), retry_max_elapsed=5
    )
    try:
        conn.join(Named("ignored-under-mtls"))
        return coordinator.fleet.membership.records[conn.client_id].info.name
    finally:
        conn.close()


def test_enroll_once_then_join_under_the_tokens_identity(tmp_path, ca_dir, service, coordinator):
    token = pki.issue_token(ca_dir, name="edge-17")
    files = device(tmp_path, ca_dir)

    assert enroll(service.address, token, name="edge-17", **files) == "edge-17"

    key_mode = stat.S_IMODE(os.stat(files["key"]).st_mode)
    assert key_mode == 0o600, oct(key_mode)
    assert pki.identity_of(Path(files["cert"]).read_bytes()) == "edge-17"
    assert [(r.name, r.kind) for r in pki.list_certs(ca_dir)] == [
        ("coordinator", "server"),
        ("edge-17", "client"),
    ]
    assert not (ca_dir / "edge-17.key").exists()  # the key never left the device
    assert join_name(coordinator, files) == "edge-17"

    # A restarted device keeps its identity: nothing is sent (nothing listens at that address).
    before = Path(files["cert"]).read_bytes()
    assert enroll("127.0.0.1:1", token, **files) == "edge-17"
    assert Path(files["cert"]).read_bytes() == before


def test_token_without_a_name_enrolls_the_default_name(tmp_path, ca_dir, service, coordinator):
    token = pki.issue_token(ca_dir)
    files = device(tmp_path, ca_dir)
    identity = enroll(service.address, token, **files)
    assert identity == f"client-{token.partition('.')[0]}"
    assert join_name(coordinator, files) == identity


def test_reused_token_is_refused_and_changes_nothing(tmp_path, ca_dir, service, coordinator):
    token = pki.issue_token(ca_dir)
    first = device(tmp_path, ca_dir, "first")
    identity = enroll(service.address, token, name="first", **first)
    index, tokens = (ca_dir / "index.json").read_bytes(), (ca_dir / "tokens.json").read_bytes()

    second = device(tmp_path, ca_dir, "second")
    with pytest.raises(RpcFailed) as info:
        enroll(service.address, token, name="second", **second)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "already used" in info.value.details

    assert (ca_dir / "index.json").read_bytes() == index and (ca_dir / "tokens.json").read_bytes() == tokens
    assert [r.name for r in pki.list_certs(ca_dir)] == ["coordinator", "first"]
    assert not Path(second["cert"]).exists()
    assert (
        stat.S_IMODE(os.stat(second["key"]).st_mode) == 0o600
    )  # written before the CSR left; kept for a new token
    assert join_name(coordinator, first) == identity


def test_revoked_token_is_refused(tmp_path, ca_dir, service):
    token = pki.issue_token(ca_dir, name="edge-1")
    pki.revoke_token(ca_dir, token.partition(".")[0])
    with pytest.raises(RpcFailed) as info:
        enroll(service.address, token, name="edge-1", **device(tmp_path, ca_dir))
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED and "revoked" in info.value.details
    assert [r.name for r in pki.list_certs(ca_dir)] == ["coordinator"]


def test_expired_token_is_refused(tmp_path, ca_dir, service, monkeypatch):
    token = pki.issue_token(ca_dir, expires=timedelta(minutes=30))
    real_now = pki_kernel.utcnow
    monkeypatch.setattr(
        pki_kernel, "utcnow", lambda: real_now() + timedelta(hours=1)
    )  # the service's clock, in this process
    with pytest.raises(RpcFailed) as info:
        enroll(service.address, token, **device(tmp_path, ca_dir))
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED and "expired" in info.value.details


def test_bad_csr_is_invalid_argument_and_spends_nothing(tmp_path, ca_dir, service):
    token = pki.issue_token(ca_dir)
    error = refusal(service, ca_dir, token, b"-----BEGIN CERTIFICATE REQUEST-----\nnot base64\n")
    assert (
        error.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "not a PEM certificate request" in error.details()
    )

    # A well-formed CSR for a name that is no identity (a newline would forge log lines).
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edge\n1")]))
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
    )
    error = refusal(service, ca_dir, token, csr)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "CSR name invalid" in error.details()
    assert "'\\n'" in error.details()  # named escaped

    assert (
        enroll(service.address, token, name="edge-1", **device(tmp_path, ca_dir)) == "edge-1"
    )  # the token is intact


def test_name_the_token_does_not_allow_is_permission_denied(tmp_path, ca_dir, service):
    token = pki.issue_token(ca_dir, name="edge-1")
    files = device(tmp_path, ca_dir)
    with pytest.raises(RpcFailed) as info:
        enroll(service.address, token, name="edge-2", **files)
    assert (
        info.value.code == grpc.StatusCode.PERMISSION_DENIED
        and "the token is for 'edge-1'" in info.value.details
    )
    # The retry with the right name reuses the key written by the first try.
    key_before = Path(files["key"]).read_bytes()
    assert enroll(service.address, token, name="edge-1", **files) == "edge-1"
    assert Path(files["key"]).read_bytes() == key_before


def test_oversized_request_is_refused_before_parsing(ca_dir, service):
    token = pki.issue_token(ca_dir)
    error = refusal(service, ca_dir, token, b"x" * (ENROLL_MAX_MESSAGE_BYTES + 1))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert "larger than max" in error.details()
    assert read_json(ca_dir / "tokens.json")["tokens"][token.partition(".")[0]]["used_at"] is None


def test_junk_request_is_invalid_argument_with_a_plain_message(ca_dir, service):
    channel, _ = stub(service, ca_dir)
    with channel, pytest.raises(grpc.RpcError) as info:
        raw = channel.unary_unary(
            "/fedgrid.v1.Enrollment/Enroll", request_serializer=None, response_deserializer=None
        )
        raw(b"\xff\xff\xff\x07junk", timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        "malformed fedgrid.v1.EnrollRequest: the request is not a valid protobuf message"
    )


def test_concurrent_enrollments_beyond_the_cap_are_resource_exhausted(tmp_path, ca_dir):
    server = EnrollmentServer("127.0.0.1:0", ca_dir=ca_dir, tls=server_tls(ca_dir), max_concurrent=1).start()
    try:
        first, second = pki.issue_token(ca_dir), pki.issue_token(ca_dir)
        _, csr_a = pki.make_csr("edge-a")
        _, csr_b = pki.make_csr("edge-b")
        lock = os.open(ca_dir / ".lock", os.O_RDWR)
        channel, s = stub(server, ca_dir)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the signing thread waits on the directory's lock
            held = s.Enroll.future(pb.EnrollRequest(token=first, csr_pem=csr_a), timeout=30)
            wait_until(
                lambda: server.servicer.in_flight == 1, timeout=10, what="the first enrollment in flight"
            )
            with pytest.raises(grpc.RpcError) as info:
                s.Enroll(pb.EnrollRequest(token=second, csr_pem=csr_b), timeout=10)
            assert (
                info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                and "in progress" in info.value.details()
            )
            fcntl.flock(lock, fcntl.LOCK_UN)
            assert held.result(timeout=30).identity == "edge-a"
            wait_until(
                lambda: server.servicer.in_flight == 0, timeout=10, what="the signing thread to finish"
            )
            assert s.Enroll(pb.EnrollRequest(token=second, csr_pem=csr_b), timeout=10).identity == "edge-b"
        finally:
            os.close(lock)
            channel.close()
    finally:
        server.stop(grace=0.5)


def test_plaintext_or_foreign_ca_refused_at_construction(tmp_path, ca_dir):
    with pytest.raises(ConfigError, match="TLS only"):
        EnrollmentServer("127.0.0.1:0", ca_dir=ca_dir, tls=None)
    other = tmp_path / "other"
    pki.init_ca(other, name="another CA")
    with pytest.raises(ConfigError, match="is not in"):
        EnrollmentServer("127.0.0.1:0", ca_dir=other, tls=server_tls(ca_dir))


def test_client_refuses_a_certificate_that_does_not_check_out(tmp_path, ca_dir, service, monkeypatch):
    """A reply whose certificate is for another key (a man in the middle with a CA-signed
    certificate of its own, or a broken service) is not written."""
    pki.issue(ca_dir, "someone-else")
    foreign = (ca_dir / "someone-else.pem").read_bytes()
    real = pb_grpc.EnrollmentStub

    class Tampering:
        def __init__(self, channel):
            self.inner = real(channel)

        def Enroll(self, request, timeout=None):
            reply = self.inner.Enroll(request, timeout=timeout)
            return pb.EnrollReply(certificate_pem=foreign, identity=reply.identity)

    monkeypatch.setattr(pb_grpc, "EnrollmentStub", Tampering)
    files = device(tmp_path, ca_dir)
    with pytest.raises(PKIError, match="does not match the certificate"):
        enroll(service.address, pki.issue_token(ca_dir), name="edge-1", **files)
    assert not Path(files["cert"]).exists()
    assert [p.name for p in Path(files["cert"]).parent.iterdir() if p.name.startswith(".")] == []


def test_cli_client_enrolls_then_trains_over_mtls(tmp_path, ca_dir):
    """``fedgrid coordinator --enroll-listen`` beside ``fedgrid client --enroll``, as processes."""
    tls = [
        "--ca",
        str(ca_dir / "ca.pem"),
        "--cert",
        str(ca_dir / "coordinator.pem"),
        "--key",
        str(ca_dir / "coordinator.key"),
        "--crl",
        str(ca_dir / "crl.pem"),
    ]
    out = tmp_path / "run"
    proc, address = start_coordinator(
        out,
        "--model",
        "linear_app:model",
        "--rounds",
        "1",
        "--min-clients",
        "1",
        "--local-epochs",
        "1",
        "--enroll-listen",
        "127.0.0.1:0",
        "--enroll-dir",
        str(ca_dir),
        *tls,
    )
    try:
        enroll_address = (out / "enroll_address").read_text().strip()  # written before RUN_DIR/address
        token_file = tmp_path / "edge.token"  # as `fedgrid certs token --out` writes it: off the command line
        token_file.write_text(pki.issue_token(ca_dir, name="edge-cli") + "\n")
        files = device(tmp_path, ca_dir)
        client = zygote.run(
            [
                *FEDGRID,
                "client",
                "--coordinator",
                address,
                "--app",
                "linear_app:client",
                "--threads",
                str(THREADS),
                "--enroll-file",
                str(token_file),
                "--enroll-address",
                enroll_address,
                "--name",
                "edge-cli",
                "--ca",
                files["ca"],
                "--cert",
                files["cert"],
                "--key",
                files["key"],
            ],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=90,
        )
        assert client.returncode == 0, client.stdout + client.stderr
        assert "identity 'edge-cli'" in client.stdout and "visible to other users" not in client.stderr
        assert proc.wait(timeout=60) == 0
        assert '"name": "edge-cli"' in (out / "events.jsonl").read_text()
        assert stat.S_IMODE(os.stat(files["key"]).st_mode) == 0o600
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


ENROLL_FILES = [
    "--enroll-address",
    "127.0.0.1:1",
    "--ca",
    "{d}/ca.pem",
    "--cert",
    "{d}/c.pem",
    "--key",
    "{d}/k",
]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--enroll", "abc.def"], "--enroll needs --enroll-address, --ca, --cert, --key"),
        (["--name", "edge-1"], "go with --enroll TOKEN, --enroll-file FILE or $FEDGRID_ENROLL_TOKEN"),
        (["--enroll", "no-dot", *ENROLL_FILES], "<token_id>.<secret>"),
        (["--enroll", "a.b", "--enroll-file", "{d}/t", *ENROLL_FILES], "not both"),
        (
            ["--enroll-file", "{d}/missing", *ENROLL_FILES],
            "cannot read {d}/missing: No such file or directory",
        ),
        (["--enroll-file", "{d}/empty", *ENROLL_FILES], "{d}/empty is empty"),
        (["--enroll-file", "{d}/big", *ENROLL_FILES], "{d}/big is over 4096 bytes"),
        (
            ["--enroll-file", "{d}/no-dot", *ENROLL_FILES],
            "<token_id>.<secret>",
        ),  # read, stripped, then checked
    ],
)
def test_cli_enroll_flags_are_checked_before_any_work(tmp_path, capsys, monkeypatch, flags, words):
    from fedgrid.cli import main

    monkeypatch.delenv("FEDGRID_ENROLL_TOKEN", raising=False)
    (tmp_path / "empty").write_text(" \n")
    (tmp_path / "big").write_text("x" * 5000)
    (tmp_path / "no-dot").write_text("no-dot\n")
    assert main(["client", "--coordinator", "127.0.0.1:1", *(f.format(d=tmp_path) for f in flags)]) == 2
    err = capsys.readouterr().err
    assert words.format(d=tmp_path) in err
    assert ("visible to other users of this machine" in err) == (
        flags[0] == "--enroll" and "--enroll-file" not in flags
    )
    assert not (tmp_path / "k").exists()


def test_cli_enroll_token_from_the_environment(tmp_path, capsys, monkeypatch):
    """$FEDGRID_ENROLL_TOKEN is the token when no flag gives one: it reaches the token check."""
    from fedgrid.cli import main

    monkeypatch.setenv("FEDGRID_ENROLL_TOKEN", " no-dot\n")
    assert (
        main(["client", "--coordinator", "127.0.0.1:1", *(f.format(d=tmp_path) for f in ENROLL_FILES)]) == 2
    )
    err = capsys.readouterr().err
    assert "<token_id>.<secret>" in err and "visible to other users" not in err
    monkeypatch.delenv("FEDGRID_ENROLL_TOKEN")
    assert (
        main(["client", "--coordinator", "127.0.0.1:1", *(f.format(d=tmp_path) for f in ENROLL_FILES)]) == 2
    )
    assert (
        "go with --enroll TOKEN" in capsys.readouterr().err
    )  # no token anywhere: the flags alone are refused
