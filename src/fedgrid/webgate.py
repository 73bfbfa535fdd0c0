"""Who may hold a connection to the HTTP status server (``fedgrid.webserve``), for how long,
and how many bytes it may send.

``Gate`` is the asyncio protocol of each accepted connection, in front of the HTTP parser's
own: a connection over the global or per-peer cap (``Admission``) is answered 503 at once and
closed, before anything is read; an admitted one is closed when ``Limits.request_timeout_s``
has passed since its accept, whatever it is doing (a slowloris peer that sends a byte now
and then is closed at the deadline, not kept alive by each byte); and it may send at most
``MAX_HEAD_BYTES`` before its headers end (431 beyond) and ``MAX_BODY_BYTES`` after them
(the rest is never read), so a connection costs a bounded amount of memory.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, cast

from fedgrid.constants import HTTP_MAX_CONNECTIONS, HTTP_MAX_CONNECTIONS_PER_PEER, HTTP_REQUEST_TIMEOUT_S

__all__ = [
    "Admission",
    "Gate",
    "Limits",
    "peer_key",
    "MAX_REQUEST_LINE",
    "MAX_HEADER_BYTES",
    "MAX_HEAD_BYTES",
    "MAX_BODY_BYTES",
    "REFUSAL_REPORT_S",
]

log = logging.getLogger(__name__)

#: Longest request line (method, path, version) accepted.
MAX_REQUEST_LINE = 4096
#: Largest total size of a request's headers (names and values).
MAX_HEADER_BYTES = 16 * 1024
#: Most bytes a connection may send before the blank line that ends its headers: the line and
#: the headers with room for their separators. More is answered 431 before it is parsed.
MAX_HEAD_BYTES = MAX_REQUEST_LINE + MAX_HEADER_BYTES + 4096
#: Bytes read after the headers (a GET has no body: it is answered 413); the rest is never read.
MAX_BODY_BYTES = 4096
#: Seconds between two warnings that connections over the caps are being refused.
REFUSAL_REPORT_S = 60.0

_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
)
_HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
)


@dataclass(frozen=True)
class Limits:
    """How long a connection may live and how many are held (defaults: ``fedgrid.constants``'
    ``HTTP_*``, each with a ``FEDGRID_*`` override).

    Raises:
        ValueError: a timeout that is not a positive number of seconds, or a cap under 1.
    """

    request_timeout_s: float = HTTP_REQUEST_TIMEOUT_S
    max_connections: int = HTTP_MAX_CONNECTIONS
    max_connections_per_peer: int = HTTP_MAX_CONNECTIONS_PER_PEER

    def __post_init__(self) -> None:
        if not (math.isfinite(self.request_timeout_s) and self.request_timeout_s > 0):
            raise ValueError(
                "request_timeout_s (FEDGRID_HTTP_REQUEST_TIMEOUT_S) must be a positive number of "
                f"seconds, got {self.request_timeout_s}"
            )
        if self.max_connections < 1:
            raise ValueError(
                f"max_connections (FEDGRID_HTTP_MAX_CONNECTIONS) must be at least 1, got {self.max_connections}"
            )
        if self.max_connections_per_peer < 1:
            raise ValueError(
                "max_connections_per_peer (FEDGRID_HTTP_MAX_CONNECTIONS_PER_PEER) must be at least 1, "
                f"got {self.max_connections_per_peer}"
            )


def peer_key(peername: Any) -> str:
    """What the per-peer cap counts for a socket's ``peername``: its IPv4 address, or its IPv6
    address's /64 (one host's usual share of addresses; an IPv4-mapped address counts as IPv4)."""
    host = peername[0] if isinstance(peername, tuple) and peername else str(peername)
    try:
        ip = ipaddress.ip_address(str(host).split("%", 1)[0])
    except ValueError:
        return str(host)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class Admission:
    """The connections held, by peer; used on the server's event loop only."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.open: set[Gate] = set()
        self._per_peer: dict[str, int] = {}
        self._refused = 0
        self._next_report = 0.0

    def admit(self, gate: Gate) -> bool:
        held = self._per_peer.get(gate.peer, 0)
        if len(self.open) >= self.limits.max_connections or held >= self.limits.max_connections_per_peer:
            self._refused += 1
            now = time.monotonic()
            if now >= self._next_report:
                log.warning(
                    "http: %d connection(s) refused with 503 over the caps (%d open, at most %d; "
                    "%d from %s, at most %d a peer)",
                    self._refused,
                    len(self.open),
                    self.limits.max_connections,
                    held,
                    gate.peer,
                    self.limits.max_connections_per_peer,
                )
                self._refused, self._next_report = 0, now + REFUSAL_REPORT_S
            return False
        self._per_peer[gate.peer] = held + 1
        self.open.add(gate)
        return True

    def release(self, gate: Gate) -> None:
        self.open.discard(gate)
        left = self._per_peer.pop(gate.peer, 1) - 1
        if left:
            self._per_peer[gate.peer] = left


class Gate(asyncio.Protocol):
    """One connection, in front of aiohttp's protocol: admitted under the caps (or answered 503
    and closed before anything is read), cut off at its deadline, and its bytes bounded."""

    def __init__(self, admission: Admission, make_protocol: Callable[[], asyncio.Protocol]) -> None:
        self._admission = admission
        self._make_protocol = make_protocol
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self.peer = ""
        self._received = 0
        self._head_end = -1  # bytes up to the end of the blank line after the headers, once seen
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)
        self.peer = peer_key(transport.get_extra_info("peername"))
        if not self._admission.admit(self):
            transport.write(_BUSY)
            transport.close()
            return
        timeout = self._admission.limits.request_timeout_s
        self._deadline = asyncio.get_running_loop().call_later(timeout, self._expire, timeout)
        self._inner = self._make_protocol()
        self._inner.connection_made(transport)

    def _expire(self, timeout: float) -> None:
        log.debug("http: closing a connection from %s at its %.1f s deadline", self.peer, timeout)
        self.abort()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._inner is None or self._transport is None:
            return
        start = self._received
        self._received += len(data)
        if self._head_end < 0:
            window = self._tail + data
            found = window.find(b"\r\n\r\n")
            if found >= 0:
                self._head_end = start - len(self._tail) + found + 4
            self._tail = window[-3:]
        if (self._head_end if self._head_end >= 0 else self._received) > MAX_HEAD_BYTES:
            if not self._transport.is_closing():
                self._transport.write(_HEAD_TOO_LARGE)
                self._transport.close()
            return
        if self._head_end >= 0 and self._received > self._head_end + MAX_BODY_BYTES:
            self._transport.pause_reading()  # never resumed by us: the deadline closes the connection
            data = data[: max(0, self._head_end + MAX_BODY_BYTES - start)]
        if data:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._inner is None:  # refused: never admitted
            return
        if self._deadline is not None:
            self._deadline.cancel()
        self._admission.release(self)
        self._inner.connection_lost(exc)
