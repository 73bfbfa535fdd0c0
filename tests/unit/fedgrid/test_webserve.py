"""``fedgrid.webserve``: read-only, bounded, loopback unless given a bearer token."""

from __future__ import annotations

import http.client
import logging
import socket
import sys

import pytest

from fedgrid import webgate, webserve
from fedgrid.errors import ConfigError
from fedgrid.webgate import peer_key
from fedgrid.webserve import MAX_REQUEST_LINE, Limits, Response, Route, StatusServer

from harness import wait_until

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


def _raw(address: str, data: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        return sock.recv(200)


def test_a_head_that_never_ends_is_cut_at_its_byte_budget_with_431(server):
    reply = _raw(server.address, b"GET /data HTTP/1.1\r\nX-Pad: " + b"a" * webgate.MAX_HEAD_BYTES)
    assert reply.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), reply
    # A body past the head is not read beyond its budget: the request is still answered (413).
    body = b"GET /data HTTP/1.1\r\nHost: x\r\nContent-Length: 65536\r\n\r\n" + b"b" * 65536
    assert _raw(server.address, body).startswith(b"HTTP/1.1 413 "), body[:10]


def test_malformed_requests_are_logged_escaped_at_debug(server, caplog):
    caplog.set_level(logging.DEBUG, logger="fedgrid.webserve")
    assert _raw(server.address, b"\x1b[2J<script>\nFAKE committed\r\n\r\n").startswith(b"HTTP/1.0 400 ")
    assert _raw(server.address, "GET /\u202eevil HTTP/1.1\r\n\r\n".encode()).startswith(b"HTTP/1.0 400 ")
    assert len(caplog.records) == 2 and all(r.levelno == logging.DEBUG for r in caplog.records)
    for record in caplog.records:  # one line each, no terminal control: the client's bytes quoted
        assert "\n" not in record.getMessage() and "\x1b" not in record.getMessage(), record.getMessage()
    assert (
        "[2J<script>" in caplog.records[0].getMessage() and "FAKE committed" in caplog.records[0].getMessage()
    )


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


def test_connections_over_the_cap_get_503_and_silent_ones_are_closed_at_the_deadline():
    s = StatusServer("127.0.0.1:0", _routes(), limits=Limits(0.5, max_connections=4)).start()
    host, port = s.address.rsplit(":", 1)
    idle = []
    try:
        for _ in range(4):  # each holds a slot, sending nothing
            idle.append(socket.create_connection((host, int(port)), timeout=10))
        wait_until(lambda: s.connections == 4, timeout=10, what="4 connections held")
        extra = socket.create_connection((host, int(port)), timeout=10)
        reply = extra.recv(200)
        extra.close()
        assert reply.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), reply
        # A silent connection is closed at its deadline (0.5 s here), which frees its slot.
        for sock in idle:
            assert sock.recv(100) == b""
        wait_until(lambda: s.connections == 0, timeout=10, what="the slots freed")
        assert _request(s.address, "GET", "/data")[0] == 200
    finally:
        for sock in idle:
            sock.close()
        s.stop()


def test_unknown_methods_get_501_and_replies_name_fedgrid(server):
    assert _request(server.address, "PROPFIND", "/data")[0] == 501
    assert _request(server.address, "BREW", "/data")[0] == 400  # not an HTTP method at all
    status, headers, _ = _request(server.address, "GET", "/data")
    assert headers["Server"] == "fedgrid" and headers["Connection"] == "close"
    assert headers["Referrer-Policy"] == "no-referrer"


def test_a_handler_that_raises_answers_500_and_the_server_keeps_serving():
    def broken() -> Response:
        raise RuntimeError("boom")

    s = StatusServer("127.0.0.1:0", {"/broken": Route(broken), **_routes()}).start()
    try:
        assert _request(s.address, "GET", "/broken")[::2] == (500, b"internal error\n")
        assert _request(s.address, "GET", "/data")[::2] == (200, b"data\n")
    finally:
        s.stop()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"request_timeout_s": 0.0}, "FEDGRID_HTTP_REQUEST_TIMEOUT_S"),
        ({"request_timeout_s": float("nan")}, "positive number of seconds"),
        ({"max_connections": 0}, "FEDGRID_HTTP_MAX_CONNECTIONS"),
        ({"max_connections_per_peer": 0}, "FEDGRID_HTTP_MAX_CONNECTIONS_PER_PEER"),
    ],
)
def test_bad_limits_are_refused_naming_the_override(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Limits(**kwargs)


def test_bad_limits_from_the_environment_stop_the_server_with_a_config_error(monkeypatch):
    monkeypatch.setattr(webserve.Limits.__init__, "__defaults__", (5.0, 0, 8))
    with pytest.raises(ConfigError, match="HTTP limits: max_connections") as info:
        StatusServer("127.0.0.1:0", _routes())
    assert info.value.key == "http"


def test_a_peer_is_an_ipv4_address_or_an_ipv6_64():
    assert peer_key(("10.1.2.3", 4000)) == "10.1.2.3"
    assert peer_key(("::ffff:10.1.2.3", 4000, 0, 0)) == "10.1.2.3"
    assert peer_key(("2001:db8:1:2:aaaa::1", 4000, 0, 0)) == peer_key(("2001:db8:1:2:bbbb::9", 1, 0, 0))
    assert peer_key(("2001:db8:1:2::1", 4000, 0, 0)) == "2001:db8:1:2::/64"
    assert peer_key(("2001:db8:1:3::1", 4000, 0, 0)) != peer_key(("2001:db8:1:2::1", 4000, 0, 0))
    assert peer_key(None) == "None"


def test_missing_aiohttp_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiohttp.web", None)  # import raises ImportError
    with pytest.raises(ConfigError, match=r"needs aiohttp: pip install 'fedgrid\[monitor\]'") as info:
        StatusServer("127.0.0.1:0", _routes())
    assert info.value.key == "http"


def test_missing_prometheus_client_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'fedgrid\[monitor\]'") as info:
        webserve.require_prometheus()
    assert info.value.key == "http"
