"""``fedgrid health``: the gRPC health of a real coordinator, plaintext and mutual TLS, as the containers' health checks ask it."""

from __future__ import annotations

import socket
import sys
from datetime import timedelta

import pytest

from fedgrid.ops import pki
from fedgrid.ops.health import check, coordinator_service
from fedgrid.proto.tls import TLSFiles
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.server.service import SERVICE

import zygote
from harness import child_env

#: ``python -m fedgrid.ops.health``: what docker/compose.yaml's health checks run.
PROBE = [sys.executable, "-m", "fedgrid.ops.health"]


def free_port() -> int:
    """A port nothing listens on: bound, read back, closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    pki.init_ca(d)
    pki.issue(d, "coordinator", server=True)
    pki.issue(d, "probe")
    other = tmp_path_factory.mktemp("other-ca")
    pki.init_ca(other, name="another CA")
    pki.issue(other, "stranger")
    return d, other


def test_the_service_name_is_the_servers():
    assert coordinator_service() == SERVICE == "fedgrid.v1.Coordinator"


def test_serving_not_serving_and_nothing_listening_over_plaintext():
    coordinator = Coordinator(
        "127.0.0.1:0", RemoteFleet(heartbeat_interval=timedelta(seconds=60)), max_workers=4
    ).start()
    try:
        result = check(coordinator.address, timeout=10)
        assert result.serving and result.line == f"{coordinator.address}: SERVING (fedgrid.v1.Coordinator)"
        assert check(coordinator.address, service="no.such.Service", timeout=10).line.endswith(
            "no health status for service 'no.such.Service' (not a fedgrid coordinator?)"
        )
        done = zygote.run(
            [*PROBE, coordinator.address], capture_output=True, text=True, env=child_env(), timeout=60
        )
        assert (done.returncode, done.stdout, done.stderr) == (
            0,
            f"fedgrid health: {coordinator.address}: SERVING (fedgrid.v1.Coordinator)\n",
            "",
        )
        coordinator.set_serving(False)  # what a stopping coordinator reports
        result = check(coordinator.address, timeout=10)
        assert (
            not result.serving
            and result.line == f"{coordinator.address}: NOT_SERVING (fedgrid.v1.Coordinator)"
        )
    finally:
        coordinator.stop(grace=0.5)

    address = f"127.0.0.1:{free_port()}"
    done = zygote.run(
        [*PROBE, address, "--timeout", "2"], capture_output=True, text=True, env=child_env(), timeout=60
    )
    assert done.returncode == 1 and done.stdout == ""
    assert (
        done.stderr.startswith(f"fedgrid health: {address}: not reachable within 2s (UNAVAILABLE: ")
        and done.stderr.count("\n") == 1
    )


def test_mutual_tls_probe_and_the_fedgrid_health_command(certs):
    d, other = certs
    server = TLSFiles(
        str(d / "ca.pem"), str(d / "coordinator.pem"), str(d / "coordinator.key"), str(d / "crl.pem")
    )
    coordinator = Coordinator(
        "127.0.0.1:0", RemoteFleet(heartbeat_interval=timedelta(seconds=60)), max_workers=4, tls=server
    ).start()
    try:
        probe = dict(ca=str(d / "ca.pem"), cert=str(d / "probe.pem"), key=str(d / "probe.key"))
        assert check(coordinator.address, **probe, timeout=10).serving
        # The server's certificate holds localhost and 127.0.0.1: another name fails the handshake.
        wrong_name = check(coordinator.address, **probe, server_name="coordinator.example", timeout=3)
        assert not wrong_name.serving and "not reachable" in wrong_name.line
        # A client certificate of another CA is refused in the handshake (the probe trusts both
        # CAs, so its own check of the files passes); no certificate at all too.
        bundle = other / "both.pem"
        bundle.write_bytes((d / "ca.pem").read_bytes() + (other / "ca.pem").read_bytes())
        stranger = check(
            coordinator.address,
            ca=str(bundle),
            cert=str(other / "stranger.pem"),
            key=str(other / "stranger.key"),
            timeout=3,
        )
        assert not stranger.serving and "UNAVAILABLE" in stranger.line
        plaintext = check(coordinator.address, timeout=3)
        assert not plaintext.serving and "UNAVAILABLE" in plaintext.line

        flags = ["--ca", probe["ca"], "--cert", probe["cert"], "--key", probe["key"]]
        done = zygote.run(
            [sys.executable, "-m", "fedgrid.cli", "health", coordinator.address, *flags],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=90,
        )
        assert (done.returncode, done.stdout) == (
            0,
            f"fedgrid health: {coordinator.address}: SERVING (fedgrid.v1.Coordinator)\n",
        )
        # Unreadable TLS files are unhealthy (1, never Docker's reserved 2), with the file named.
        done = zygote.run(
            [
                *PROBE,
                coordinator.address,
                "--ca",
                probe["ca"],
                "--cert",
                str(d / "missing.pem"),
                "--key",
                probe["key"],
            ],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=60,
        )
        assert (
            done.returncode == 1
            and done.stderr.startswith("fedgrid health: ")
            and "missing.pem" in done.stderr
        )
    finally:
        coordinator.stop(grace=0.5)


def test_refused_handshakes_leave_no_raw_grpc_core_lines_in_the_coordinators_log(certs, tmp_path):
    """A stranger's certificate and a plaintext dial fail the handshake; the coordinator's log
    gets none of gRPC core's lines for them ("ssl_transport_security.cc:2563] Handshake failed
    with error SSL_ERROR_SSL: ..."): the CLI sets GRPC_VERBOSITY=NONE unless the environment
    names a level. (A fresh interpreter: gRPC reads the variable once, at its import.)"""
    import subprocess

    d, other = certs
    out = tmp_path / "run"
    log = tmp_path / "coordinator.log"
    tls = [
        "--ca",
        str(d / "ca.pem"),
        "--cert",
        str(d / "coordinator.pem"),
        "--key",
        str(d / "coordinator.key"),
    ]
    env = {k: v for k, v in child_env().items() if k != "GRPC_VERBOSITY"}
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fedgrid.cli",
                "coordinator",
                "--listen",
                "127.0.0.1:0",
                "--out",
                str(out),
                *tls,
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        from harness import wait_until

        wait_until(lambda: (out / "address").exists() or proc.poll() is not None, timeout=60, what="address")
        address = (out / "address").read_text().strip()
        bundle = tmp_path / "both.pem"
        bundle.write_bytes((d / "ca.pem").read_bytes() + (other / "ca.pem").read_bytes())
        stranger = dict(ca=str(bundle), cert=str(other / "stranger.pem"), key=str(other / "stranger.key"))
        assert not check(address, **stranger, timeout=3).serving
        assert not check(address, timeout=3).serving  # plaintext
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    text = log.read_text()
    assert "fedgrid.server.serve" in text  # the coordinator's own lines are there
    assert "ssl_transport_security" not in text and "Handshake failed" not in text, text
