"""``fedgrid.webserve``: read-only, bounded, loopback unless given a bearer token."""

from __future__ import annotations

import http.client
import socket
import sys

import pytest

from fedgrid import webserve
from fedgrid.errors import ConfigError
from fedgrid.webserve import MAX_CONNECTIONS, MAX_REQUEST_LINE, Response, Route, StatusServer

TOKEN = "s3cret-token-0123456789"


def _routes() -> dict[str, Route]:
    return {
        "/data": Route(lambda: Response(b"data\n")),
        "/": Route(lambda: Response(b"<p>page</p>", content_type="text/html"), public=True),
    }


@pytest.fixture
def server():
    s = StatusServer("127.0.0.1:0", _routes()).start()
    yield s
    s.stop()


def _request(
    address: str, method: str, path: str, *, headers: dict[str, str] | None = None, body: bytes | None = None
):
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


def test_get_and_head_are_served_on_loopback_with_hardening_headers(server):
    status, headers, body = _request(server.address, "GET", "/data")
    assert (status, body) == (200, b"data\n")
    assert headers["Cache-Control"] == "no-store" and headers["X-Content-Type-Options"] == "nosniff"
    status, headers, body = _request(server.address, "HEAD", "/data")
    assert (status, body, headers["Content-Length"]) == (200, b"", "5")
    assert _request(server.address, "GET", "/nothing")[0] == 404
    assert _request(server.address, "GET", "/data?x=1")[0] == 200  # a query does not change the route


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_writes_are_refused_with_405(server, method):
    status, headers, _ = _request(server.address, method, "/data", body=b"x")
    assert status == 405
    assert headers["Allow"] == "GET, HEAD"


def test_oversized_or_bodied_requests_are_refused(server):
    assert _request(server.address, "GET", "/" + "a" * MAX_REQUEST_LINE)[0] == 414
    assert (
        _request(server.address, "GET", "/data", headers={"X-Big": "b" * (webserve.MAX_HEADER_BYTES + 1)})[0]
        == 431
    )
    assert _request(server.address, "GET", "/data", body=b"payload")[0] == 413


def test_non_loopback_without_token_refuses_to_start(tmp_path):
    with pytest.raises(ConfigError, match="not a loopback address.*bearer token") as info:
        StatusServer("0.0.0.0:0", _routes())
    assert info.value.key == "http"
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ConfigError, match="at least 16") as info:
        StatusServer("0.0.0.0:0", _routes(), token_file=str(short))
    assert info.value.key == "http_token_file"
    with pytest.raises(ConfigError, match="cannot read the token file"):
        StatusServer("0.0.0.0:0", _routes(), token_file=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        StatusServer("127.0.0.1", _routes())


def test_bearer_token_guards_data_but_not_the_static_page(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    s = StatusServer("0.0.0.0:0", _routes(), token_file=str(token_file)).start()
    try:
        local = "127.0.0.1:" + s.address.rsplit(":", 1)[1]
        status, headers, _ = _request(local, "GET", "/data")
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        assert (
            _request(local, "GET", "/data", headers={"Authorization": "Bearer wrong-token-0123456789"})[0]
            == 401
        )
        assert _request(local, "GET", "/data", headers={"Authorization": f"Basic {TOKEN}"})[0] == 401
        assert _request(local, "GET", "/data", headers={"Authorization": f"Bearer {TOKEN}"})[:3:2] == (
            200,
            b"data\n",
        )
        assert _request(local, "GET", "/")[0] == 200  # static HTML, no data
        assert _request(local, "POST", "/data", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 405
    finally:
        s.stop()


def test_connections_over_the_cap_get_503_and_silent_ones_time_out(monkeypatch):
    monkeypatch.setattr(webserve._Handler, "timeout", 1.0)
    s = StatusServer("127.0.0.1:0", _routes()).start()
    host, port = s.address.rsplit(":", 1)
    idle = []
    try:
        for _ in range(MAX_CONNECTIONS):  # each holds a slot, sending nothing
            idle.append(socket.create_connection((host, int(port)), timeout=10))
        # The slots are taken once the server accepted all of them: the next one is refused.
        extra = socket.create_connection((host, int(port)), timeout=10)
        reply = extra.recv(200)
        extra.close()
        assert reply.startswith(b"HTTP/1.0 503"), reply
        # A silent connection is closed after the read timeout (1 s here), which frees its slot.
        for sock in idle:
            assert sock.recv(100) == b""
        assert _request(s.address, "GET", "/data")[0] == 200
    finally:
        for sock in idle:
            sock.close()
        s.stop()


def test_missing_prometheus_client_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'fedgrid\[monitor\]'") as info:
        webserve.require_prometheus()
    assert info.value.key == "http"
