"""A small read-only HTTP server for watching a process: ``/metrics``, ``/api/status``, a page.

The coordinator and ``fedgrid client`` serve their live state with it when given ``--http
HOST:PORT`` (port 0 picks a free one). It is a stdlib ``ThreadingHTTPServer`` in a daemon
thread: nothing it serves changes the run, and a slow or hostile reader cannot reach the
training loop. Its rules:

- **Read-only**: GET and HEAD only; POST, PUT, DELETE, PATCH and OPTIONS get 405 (with
  ``Allow: GET, HEAD``), other methods the stdlib's 501.
- **Bounded**: a request line over ``MAX_REQUEST_LINE`` bytes gets 414, headers over
  ``MAX_HEADER_BYTES`` 431, a request with a body 413; a connection must send its request
  within ``READ_TIMEOUT_S``; at most ``MAX_CONNECTIONS`` connections are served at once
  (more get 503 and are closed), and each connection serves one request.
- **Loopback by default**: on a non-loopback address the server refuses to start
  (``ConfigError``) unless it has a bearer token (``token_file``: a file holding the token,
  at least ``MIN_TOKEN_CHARS`` characters). With a token every data route needs
  ``Authorization: Bearer TOKEN`` (compared with ``hmac.compare_digest``; 401 otherwise).
  Routes marked ``public`` (the status page, which is static HTML holding no data) are
  served without it; the page's script then reads the token from the URL fragment
  (``http://HOST:PORT/#token=TOKEN``, which browsers never send to servers or in a
  ``Referer``) and sends it on its own requests. A token on loopback is honoured too.
- Request lines are logged through ``fedgrid.textsafe.escape``: a path is client text.

Routes are a mapping ``path -> Route``; a route's handler returns a ``Response``.
"""

from __future__ import annotations

import hmac
import logging
import threading
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Mapping

from fedgrid.errors import ConfigError
from fedgrid.proto.tls import is_loopback
from fedgrid.textsafe import escape

__all__ = [
    "Response",
    "Route",
    "StatusServer",
    "require_prometheus",
    "read_token",
    "split_address",
    "MAX_CONNECTIONS",
    "READ_TIMEOUT_S",
    "MAX_REQUEST_LINE",
    "MAX_HEADER_BYTES",
    "MIN_TOKEN_CHARS",
    "MONITOR_EXTRA",
]

log = logging.getLogger(__name__)

#: Connections served at once; more are answered 503 and closed.
MAX_CONNECTIONS = 16
#: Seconds a connection has to send its request (and the longest a reply may stall).
READ_TIMEOUT_S = 5.0
#: Longest request line (method, path, version) accepted.
MAX_REQUEST_LINE = 4096
#: Largest total size of a request's headers.
MAX_HEADER_BYTES = 16 * 1024
#: Shortest bearer token accepted from a token file.
MIN_TOKEN_CHARS = 16
#: The optional dependency group that brings ``prometheus-client``.
MONITOR_EXTRA = "monitor"

_READ_ONLY = ("POST", "PUT", "DELETE", "PATCH", "OPTIONS")


def require_prometheus() -> Any:
    """The ``prometheus_client`` module, or a ``ConfigError`` naming the extra to install."""
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError(
            "http",
            f"serving metrics needs prometheus-client: pip install 'fedgrid[{MONITOR_EXTRA}]' "
            "(or pip install prometheus-client)",
        ) from None
    return prometheus_client


def split_address(address: str, *, key: str = "http") -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets) as ``(host, port)``.

    Raises:
        ConfigError: not ``HOST:PORT`` with a port in 0..65535 (named by ``key``).
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(key, f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def read_token(path: str, *, key: str = "http_token_file") -> str:
    """The bearer token in the file ``path`` (surrounding whitespace removed).

    Raises:
        ConfigError: the file cannot be read, or holds fewer than ``MIN_TOKEN_CHARS``
            characters or whitespace inside the token.
    """
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(key, f"cannot read the token file {path!r}: {exc}") from None
    if len(token) < MIN_TOKEN_CHARS or any(ch.isspace() or not ch.isprintable() for ch in token):
        raise ConfigError(
            key, f"{path!r} must hold one token of at least {MIN_TOKEN_CHARS} printable characters, no spaces"
        )
    return token


@dataclass(frozen=True)
class Response:
    """What a route answers: status, content type, body and extra headers."""

    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Route:
    """A GET route. ``public``: served without the bearer token (static content only)."""

    handler: Callable[[], Response]
    public: bool = False


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = MAX_CONNECTIONS

    def __init__(
        self, address: tuple[str, int], handler: type, *, routes: Mapping[str, Route], token: str | None
    ) -> None:
        import socket

        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.routes = routes
        self.token = token
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Over the cap: answered at once on this thread and closed, so no thread is spent on it.
        if not self.slots.acquire(blocking=False):
            try:
                request.sendall(
                    b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    raw_requestline: bytes
    timeout = READ_TIMEOUT_S  # socket timeout: a slow sender is dropped
    server_version = "fedgrid"
    sys_version = ""
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive holds a slot

    def parse_request(self) -> bool:
        if len(self.raw_requestline) > MAX_REQUEST_LINE:
            self.command, self.request_version, self.requestline = "", self.protocol_version, "(too long)"
            self.close_connection = True
            self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)
            return False
        if not super().parse_request():
            return False
        if sum(len(k) + len(v) for k, v in self.headers.items()) > MAX_HEADER_BYTES:
            self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
            return False
        return True

    def _refuse_method(self) -> None:
        self.send_response(HTTPStatus.METHOD_NOT_ALLOWED)
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method

    def _authorized(self) -> bool:
        token = self.server.token
        if token is None:
            return True
        given = self.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())

    def _answer(self, head_only: bool) -> None:
        if self.headers.get("Content-Length", "0") not in ("", "0") or "Transfer-Encoding" in self.headers:
            self.send_error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "a GET carries no body")
            return
        route = self.server.routes.get(self.path.split("?", 1)[0])
        if route is None:
            response = Response(b"not found\n", status=404)
        elif not route.public and not self._authorized():
            response = Response(
                b"unauthorized: send Authorization: Bearer TOKEN\n",
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="fedgrid"'},
            )
        else:
            try:
                response = route.handler()
            except Exception:  # noqa: BLE001 - a broken view must not take the server down
                log.exception("http: %s failed", escape(self.path, 128))
                response = Response(b"internal error\n", status=500)
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.end_headers()
        if not head_only:
            self.wfile.write(response.body)

    def do_GET(self) -> None:
        self._answer(head_only=False)

    def do_HEAD(self) -> None:
        self._answer(head_only=True)

    def log_message(self, format: str, *args: Any) -> None:
        # The request line and paths are client text: escaped, never written verbatim.
        log.debug("http %s: %s", self.client_address[0], escape(format % args, 300))


class StatusServer:
    """Serves ``routes`` on ``address`` in a daemon thread; ``address`` holds the bound port.

    Args:
        address: ``HOST:PORT``; port 0 binds a free one.
        routes: path -> ``Route``.
        token_file: a file holding the bearer token; required on a non-loopback host.
        key: the config key named in errors.

    Raises:
        ConfigError: a malformed address, a non-loopback host without a token file, an
            unreadable or too short token, or an address that cannot be bound.
    """

    def __init__(
        self, address: str, routes: Mapping[str, Route], *, token_file: str = "", key: str = "http"
    ) -> None:
        host, port = split_address(address, key=key)
        token = read_token(token_file, key=f"{key}_token_file") if token_file else None
        if token is None and not is_loopback(host):
            raise ConfigError(
                key,
                f"{host!r} is not a loopback address: serving status there needs a bearer token "
                f"({key}_token_file: a file holding at least {MIN_TOKEN_CHARS} characters), "
                "or bind 127.0.0.1 and reach it through a tunnel",
            )
        try:
            self._server = _Server((host, port), _Handler, routes=routes, token=token)
        except OSError as exc:
            raise ConfigError(key, f"cannot listen on {address}: {exc}") from None
        bound = self._server.server_address[1]
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        self.authenticated = token is not None
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, name="fedgrid-http", daemon=True
        )

    def start(self) -> "StatusServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving and closes the socket (requests in flight finish on their threads)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5.0)
        self._server.server_close()
