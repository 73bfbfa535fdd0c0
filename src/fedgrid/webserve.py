"""A small read-only HTTP server for watching a process: ``/metrics``, ``/api/status``, a page.

The coordinator and ``fedgrid client`` serve their live state with it when given ``--http
HOST:PORT`` (port 0 picks a free one). It is aiohttp's low-level server on an asyncio event
loop of its own, in a daemon thread; route handlers run on a small thread pool. Nothing it
serves changes the run, and a slow or hostile reader cannot reach the training loop. Its rules:

- **Read-only**: GET and HEAD only; POST, PUT, DELETE, PATCH and OPTIONS get 405 (with
  ``Allow: GET, HEAD``), other methods 501.
- **Bounded**: a request line over ``MAX_REQUEST_LINE`` bytes gets 414, headers over
  ``MAX_HEADER_BYTES`` 431, a request with a body 413 (and what is not HTTP at all 400). A connection serves one request, and
  has ``Limits.request_timeout_s`` from its accept to send all of it (headers and body) and
  take its answer: then it is closed, however slowly it drips bytes (slowloris). It may send
  at most ``MAX_HEAD_BYTES`` before its headers end (431 beyond) and ``MAX_BODY_BYTES`` after
  (the rest is never read). At most ``Limits.max_connections`` connections are held at once,
  and ``Limits.max_connections_per_peer`` from one peer (an IPv4 address, an IPv6 /64); a
  connection over either cap is answered 503 at once and closed, before anything is read.
- **Loopback by default**: on a non-loopback address the server refuses to start
  (``ConfigError``) unless it has a bearer token (``token_file``: a file holding the token,
  at least ``MIN_TOKEN_CHARS`` characters). With a token every data route needs
  ``Authorization: Bearer TOKEN`` (compared with ``hmac.compare_digest``; 401 otherwise).
  Routes marked ``public`` (the status page, which is static HTML holding no data) are
  served without it; the page's script then reads the token from the URL fragment
  (``http://HOST:PORT/#token=TOKEN``, which browsers never send to servers or in a
  ``Referer``) and sends it on its own requests. A token on loopback is honoured too.
- Request lines, and aiohttp's messages about malformed requests, are logged through
  ``fedgrid.textsafe.escape``: they are client text.

Routes are a mapping ``path -> Route``; a route's handler returns a ``Response``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib
import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Mapping, cast

from fedgrid.errors import ConfigError
from fedgrid.proto.tls import is_loopback
from fedgrid.textsafe import escape
from fedgrid.webgate import MAX_HEAD_BYTES, MAX_HEADER_BYTES, MAX_REQUEST_LINE, Admission, Gate, Limits

if TYPE_CHECKING:
    from aiohttp import web

__all__ = [
    "Limits",
    "Response",
    "Route",
    "StatusServer",
    "dispatch",
    "require_aiohttp",
    "require_prometheus",
    "read_token",
    "split_address",
    "MAX_REQUEST_LINE",
    "MAX_HEADER_BYTES",
    "MIN_TOKEN_CHARS",
    "MONITOR_EXTRA",
]

log = logging.getLogger(__name__)

#: Shortest bearer token accepted from a token file.
MIN_TOKEN_CHARS = 16
#: The optional dependency group that brings ``prometheus-client`` and ``aiohttp``.
MONITOR_EXTRA = "monitor"
#: Threads that run route handlers (which read the process's state under its locks).
HANDLER_THREADS = 4
#: Longest wait for the server's thread to start serving or to stop.
THREAD_TIMEOUT_S = 10.0

_READ_ONLY = ("POST", "PUT", "DELETE", "PATCH", "OPTIONS")
_HARDENING = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _require(module: str, package: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            "http",
            f"{what} needs {package}: pip install 'fedgrid[{MONITOR_EXTRA}]' (or pip install {package})",
        ) from None


def require_prometheus() -> Any:
    """The ``prometheus_client`` module, or a ``ConfigError`` naming the extra to install."""
    return _require("prometheus_client", "prometheus-client", "serving metrics")


def require_aiohttp() -> Any:
    """The ``aiohttp.web`` module, or a ``ConfigError`` naming the extra to install."""
    return _require("aiohttp.web", "aiohttp", "serving HTTP (--http)")


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


class _EscapedLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger. Its messages about malformed requests quote the client's bytes:
    they are escaped, logged without a traceback, and at debug level (a peer's bad request is
    the peer's problem, and a stream of them must not flood the log); other errors warn."""

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = kwargs.get("exc_info")
        quiet = exc is None or isinstance(exc, (HttpProcessingError, ConnectionError, asyncio.CancelledError))
        level = logging.DEBUG if quiet else logging.WARNING
        if not self.logger.isEnabledFor(level):
            return
        try:
            text = str(msg) % args if args else str(msg)
        except (TypeError, ValueError):
            text = f"{msg} {args}"
        if isinstance(exc, BaseException):
            text = f"{text}: {type(exc).__name__}: {exc}"
        self.logger.log(level, "http: %s", escape(text, 300))


def dispatch(
    *,
    method: str,
    target: str,
    headers: Mapping[str, str],
    header_bytes: int,
    routes: Mapping[str, Route],
    token: str | None,
) -> Response | Route:
    """What a parsed request gets: a ``Response`` at once (refused, not found, unauthorized),
    or the ``Route`` whose handler answers it."""
    if len(method) + len(target) + len(" HTTP/1.1") + 1 > MAX_REQUEST_LINE:
        return Response(b"request line too long\n", status=414)
    if header_bytes > MAX_HEADER_BYTES:
        return Response(b"request headers too large\n", status=431)
    if method in _READ_ONLY:
        return Response(b"", status=405, headers={"Allow": "GET, HEAD"})
    if method not in ("GET", "HEAD"):
        return Response(b"not implemented\n", status=501)
    if headers.get("Content-Length", "0") not in ("", "0") or "Transfer-Encoding" in headers:
        return Response(b"a GET carries no body\n", status=413)
    route = routes.get(target.split("?", 1)[0])
    if route is None:
        return Response(b"not found\n", status=404)
    if not route.public and not _authorized(headers.get("Authorization", ""), token):
        return Response(
            b"unauthorized: send Authorization: Bearer TOKEN\n",
            status=401,
            headers={"WWW-Authenticate": 'Bearer realm="fedgrid"'},
        )
    return route


def _authorized(given: str, token: str | None) -> bool:
    if token is None:
        return True
    scheme, _, value = given.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


def _call(route: Route, target: str) -> Response:
    try:
        return route.handler()
    except Exception:  # noqa: BLE001 - a broken view must not take the server down
        log.exception("http: %s failed", escape(target, 128))
        return Response(b"internal error\n", status=500)


class StatusServer:
    """Serves ``routes`` on ``address`` from an event loop in a daemon thread; ``address``
    holds the bound port.

    Args:
        address: ``HOST:PORT``; port 0 binds a free one.
        routes: path -> ``Route``.
        token_file: a file holding the bearer token; required on a non-loopback host.
        key: the config key named in errors.
        limits: the request deadline and connection caps (``Limits()``: the defaults).

    Raises:
        ConfigError: aiohttp is not installed, a malformed address, a non-loopback host without
            a token file, an unreadable or too short token, bad limits (their ``FEDGRID_*``
            overrides), or an address that cannot be bound.
    """

    def __init__(
        self,
        address: str,
        routes: Mapping[str, Route],
        *,
        token_file: str = "",
        key: str = "http",
        limits: Limits | None = None,
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
        self._web = require_aiohttp()
        try:
            self.limits = limits if limits is not None else Limits()
        except ValueError as exc:
            raise ConfigError(key, f"HTTP limits: {exc}") from None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        dualstack = host == "::" and socket.has_dualstack_ipv6()
        try:
            self._sock = socket.create_server((host, port), family=family, dualstack_ipv6=dualstack)
        except OSError as exc:
            raise ConfigError(key, f"cannot listen on {address}: {exc}") from None
        bound = self._sock.getsockname()[1]
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        self.authenticated = token is not None
        self._key, self._routes, self._token = key, dict(routes), token
        self._admission = Admission(self.limits)
        self._pool = ThreadPoolExecutor(HANDLER_THREADS, thread_name_prefix="fedgrid-http-view")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fedgrid-http", daemon=True)

    @property
    def connections(self) -> int:
        """Connections held now (admitted and not yet closed)."""
        return len(self._admission.open)

    def start(self) -> "StatusServer":
        """Starts serving; returns when the server accepts connections.

        Raises:
            ConfigError: the event loop could not start serving.
        """
        self._thread.start()
        if not self._ready.wait(THREAD_TIMEOUT_S) or self._failure is not None:
            self.stop()
            reason = self._failure or f"not serving after {THREAD_TIMEOUT_S:.0f} s"
            raise ConfigError(self._key, f"cannot serve HTTP on {self.address}: {reason}")
        return self

    def stop(self) -> None:
        """Stops serving: closes the socket and every connection still open."""
        loop = self._loop
        if loop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop has just closed
                loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=THREAD_TIMEOUT_S)
        self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        self._loop = loop = asyncio.new_event_loop()
        try:
            server = loop.run_until_complete(self._open())
        except Exception as exc:  # noqa: BLE001 - reported by start()
            self._failure = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._close(server))
            loop.close()

    async def _open(self) -> asyncio.Server:
        protocol = self._web.Server(
            self._handle,
            access_log=None,  # requests are logged by _handle, escaped
            logger=_EscapedLog(log, {}),
            keepalive_timeout=self.limits.request_timeout_s,
            # The gate bounds the head first (431), so aiohttp's own limits never answer first.
            max_line_size=2 * MAX_HEAD_BYTES,
            max_field_size=2 * MAX_HEAD_BYTES,
        )
        return await asyncio.get_running_loop().create_server(
            lambda: Gate(self._admission, protocol), sock=self._sock
        )

    async def _close(self, server: asyncio.Server) -> None:
        server.close()
        for gate in list(self._admission.open):
            gate.abort()
        current = asyncio.current_task()
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        target = request.raw_path
        answer = dispatch(
            method=request.method,
            target=target,
            headers=request.headers,
            header_bytes=sum(len(k) + len(v) for k, v in request.raw_headers),
            routes=self._routes,
            token=self._token,
        )
        if isinstance(answer, Route):
            answer = await asyncio.get_running_loop().run_in_executor(self._pool, _call, answer, target)
        log.debug(
            "http %s: %s %s %d",
            request.remote,
            escape(request.method, 16),
            escape(target, 300),
            answer.status,
        )
        headers = {"Content-Type": answer.content_type, "Server": "fedgrid", **_HARDENING, **answer.headers}
        reply = self._web.Response(body=answer.body, status=answer.status, headers=headers)
        reply.force_close()  # one request per connection: no idle keep-alive holds a slot
        return cast("web.StreamResponse", reply)
