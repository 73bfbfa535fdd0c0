"""``import fedgrid`` in a fresh interpreter: the public surface is lazy, and a base module does not
pull the layers above it (each test starts a Python process)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest


def _in_fresh_interpreter(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout)


def test_import_fedgrid_loads_neither_torch_nor_grpc_nor_the_layers():
    loaded = _in_fresh_interpreter(
        "import json, sys, fedgrid; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'grpc', 'fedgrid'))))"
    )
    assert loaded == ["fedgrid", "fedgrid.lazy"]  # the lazy re-export mechanism, nothing else


def test_a_base_module_does_not_pull_the_layers_above_it():
    loaded = _in_fresh_interpreter(
        "import json, sys, fedgrid.config; print(json.dumps(sorted(m for m in sys.modules if m.startswith('fedgrid.'))))"
    )
    assert not [
        m
        for m in loaded
        if m.startswith(("fedgrid.server", "fedgrid.client", "fedgrid.simulation", "fedgrid.proto"))
    ]


def test_transformers_is_imported_only_to_build_an_hf_model():
    loaded = _in_fresh_interpreter(
        "import json, sys, fedgrid.cli.simulate, fedgrid.cli.client, fedgrid.cli.coordinator, fedgrid.simulation.run;"
        "from fedgrid.simulation.tasks import build_model; build_model('shakespeare', 'gpt:dim=32');"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'huggingface_hub'))))"
    )
    assert loaded == []  # the hf extra is optional: only --model hf:PATH imports it


#: ``fedgrid ARGS`` as the console script runs it (``fedgrid.cli:main``) in a fresh interpreter;
#: after it returns, the heavy modules it loaded go to the file named first.
CLI = (
    "import json, sys; from fedgrid.cli import main; rc = main(sys.argv[2:]);"
    "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy') or m == 'fedgrid.config');"
    "open(sys.argv[1], 'w').write(json.dumps(heavy)); sys.exit(rc)"
)


def _fedgrid(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    loaded = tmp_path / "loaded.json"
    done = subprocess.run(
        [sys.executable, "-c", CLI, str(loaded), *args], capture_output=True, text=True, timeout=120
    )
    return done, json.loads(loaded.read_text()) if loaded.exists() else ["(main did not return)"]


@pytest.fixture
def status_double():
    """A stand-in for a coordinator's ``--http`` server: ``/api/status`` answers a status (the
    server itself is tested in test_http_status.py; here only the client's imports matter)."""
    body = json.dumps(
        {"run_id": "r1", "state": "running", "phase": "fit", "round": 2, "rounds": 5, "clients": []}
    ).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/api/status" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _health_server(d: Path) -> tuple[grpc.Server, str]:
    """A mutual-TLS gRPC server that reports the coordinator's service SERVING, with the
    certificates ``fedgrid certs`` made in ``d``."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("fedgrid.v1.Coordinator", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials(
        [((d / "site.key").read_bytes(), (d / "site.pem").read_bytes())],
        root_certificates=(d / "ca.pem").read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    return server.start() or server, f"127.0.0.1:{port}"


def test_certs_health_and_status_import_no_torch(tmp_path, status_double):
    """The commands an operator runs to bootstrap and watch a site load neither torch nor the
    config (each used to cost torch's import, about 2 s: a dozen ``fedgrid certs`` calls, 30 s)."""
    d = tmp_path / "ca"
    for args in (
        ["certs", "init", "--dir", str(d)],
        ["certs", "issue", "--dir", str(d), "--name", "site", "--server", "--san", "127.0.0.1"],
        ["certs", "issue", "--dir", str(d), "--name", "probe"],
        ["certs", "list", "--dir", str(d)],
        ["certs", "token", "--dir", str(d), "--name", "client-7", "--out", str(tmp_path / "token")],
    ):
        done, heavy = _fedgrid(tmp_path, *args)
        assert (done.returncode, heavy) == (0, []), (args, done.stderr)
    assert {p.name for p in d.glob("*.pem")} == {"ca.pem", "crl.pem", "site.pem", "probe.pem"}
    assert (tmp_path / "token").read_text().count(".") == 1

    server, address = _health_server(d)
    try:
        tls = ["--ca", str(d / "ca.pem"), "--cert", str(d / "probe.pem"), "--key", str(d / "probe.key")]
        done, heavy = _fedgrid(tmp_path, "health", address, *tls)
    finally:
        server.stop(grace=None)
    assert (done.returncode, done.stdout, heavy) == (
        0,
        f"fedgrid health: {address}: SERVING (fedgrid.v1.Coordinator)\n",
        [],
    )

    done, heavy = _fedgrid(tmp_path, "status", status_double)
    assert (done.returncode, heavy) == (0, []) and "2 / 5" in done.stdout, done.stderr
