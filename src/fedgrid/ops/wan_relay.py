"""The relay of ``fedgrid.ops.wan``: a TCP relay that carries every connection it accepts to a
target through an emulated WAN link (``fedgrid.ops.wan_link``'s model; both are described in
``fedgrid.ops.wan``). It runs an asyncio loop in a thread of its own; its public methods are
called from other threads.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import struct
import threading
from collections import deque
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Coroutine, TypeVar

from fedgrid.errors import ConfigError
from fedgrid.ops.wan_link import (
    MAX_CONNECTIONS,
    READ_BYTES,
    LinkClock,
    WanLink,
)

__all__ = ["WanRelay", "parse_hostport", "CONNECT_TIMEOUT_S", "CONTROL_TIMEOUT_S", "PARTITION_MODES"]

# The relay's records keep the name of the module that presents it (and always did).
log = logging.getLogger("fedgrid.ops.wan")
T = TypeVar("T")

#: Deadline of the relay's own connect to the target (loopback or a LAN: seconds are plenty).
CONNECT_TIMEOUT_S = 10.0
#: Deadline of start(), stop(), partition() and heal() waiting on the relay's loop.
CONTROL_TIMEOUT_S = 10.0
PARTITION_MODES = ("blackhole", "reset")


def _reset(writer: asyncio.StreamWriter | None) -> None:
    """Closes a connection with a RST (SO_LINGER 0), as a real path reset would look to its peer."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:  # already closed
            pass
    writer.transport.abort()


class _Pipe:
    """One direction of one connection: ``pump`` reads and schedules, ``deliver`` writes on time."""

    def __init__(
        self,
        relay: "WanRelay",
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        clock: LinkClock,
        up: bool,
    ) -> None:
        self.relay, self.src, self.dst, self.clock, self.up = relay, src, dst, clock, up
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued = 0
        self.changed = asyncio.Event()

    async def _until(self, condition: Any) -> None:
        while not condition():
            self.changed.clear()
            await self.changed.wait()

    def _put(self, arrival: float, piece: bytes) -> None:
        self.queue.append((arrival, piece))
        self.queued += len(piece)
        self.changed.set()

    async def pump(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await self.src.read(READ_BYTES)
            if not data:  # the sender's FIN crosses the link after its data, and not through a partition
                await self.relay._passable()
                self._put(max(self.clock.last_arrival, loop.time() + self.relay.link.delay_ms / 1000), b"")
                return
            link = self.relay.link
            step = link.piece_bytes
            for i in range(0, len(data), step):
                piece = data[i : i + step]
                while True:
                    await self.relay._passable()
                    link = self.relay.link
                    await self._until(lambda: self.queued < link.buffer_bytes)
                    wait = self.clock.ready_at() - loop.time()
                    if wait <= 0 and self.relay._healed.is_set():
                        break
                    if wait > 0:
                        await asyncio.sleep(wait)
                lost = self.clock.lost
                arrival = self.clock.schedule(len(piece), loop.time(), link)
                self.relay.segments_lost += self.clock.lost - lost
                self._put(arrival, piece)

    async def deliver(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._until(lambda: bool(self.queue))
            arrival, piece = self.queue[0]
            wait = arrival - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            await self.relay._passable()
            self.queue.popleft()
            if not piece:
                if self.dst.can_write_eof():
                    self.dst.write_eof()
                return
            self.relay._count(
                self.up, len(piece)
            )  # first: the peer may read the bytes before write() returns
            self.dst.write(piece)
            await self.dst.drain()
            self.queued -= len(piece)
            self.changed.set()


@dataclass
class _Connection:
    index: int
    client: asyncio.StreamWriter
    task: asyncio.Task[Any] | None
    target: asyncio.StreamWriter | None = None

    def reset(self) -> None:
        _reset(self.client)
        _reset(self.target)


class WanRelay:
    """A TCP relay that forwards every connection accepted on ``listen`` to ``target``
    through an emulated WAN link (``fedgrid.ops.wan``'s docstring: the model, partitions, bounds).

    Use it as a context manager, or ``start()`` and ``stop()``::

        with WanRelay(("127.0.0.1", server_port), WanLink(delay_ms=25, rate_mbit=20)) as relay:
            channel = grpc.insecure_channel(relay.address)

    Args:
        target: ``(host, port)`` (or ``"HOST:PORT"``) every connection is forwarded to.
        link: the link both ways (``WanLink()``: none).
        listen: ``(host, port)`` (or ``"HOST:PORT"``) to bind; port 0 picks a free one.
            Loopback by default: any other host must be given explicitly.
        max_connections: connections open at once; more are reset on arrival.

    Raises:
        ConfigError: a bad address or ``max_connections``.
    """

    def __init__(
        self,
        target: tuple[str, int] | str,
        link: WanLink | None = None,
        listen: tuple[str, int] | str = ("127.0.0.1", 0),
        *,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if max_connections < 1:
            raise ConfigError("max_connections", f"must be at least 1, not {max_connections}")
        self.target = parse_hostport(target, key="target") if isinstance(target, str) else target
        self.listen = parse_hostport(listen, key="listen") if isinstance(listen, str) else listen
        self.max_connections = max_connections
        self._link = link if link is not None else WanLink()
        #: Bytes delivered to the target.
        self.bytes_up = 0
        #: Bytes delivered back to the connecting side.
        self.bytes_down = 0
        #: Connections accepted and forwarded since start.
        self.connections_total = 0
        #: Connections reset on arrival (a reset partition, ``max_connections`` reached).
        self.connections_refused = 0
        #: Segments lost (each delivered one RTO late), both directions.
        self.segments_lost = 0
        self._lines = {True: [0.0], False: [0.0]}
        self._mode: str | None = None
        self._conns: dict[int, _Connection] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        # Set while no partition holds traffic (an asyncio.Event binds to a loop on first use: made anew in start()).
        self._healed = asyncio.Event()
        self._port = 0

    # -- the public API (any thread but the relay's) --------------------------------------------

    @property
    def link(self) -> WanLink:
        """The link in force (``set_link`` changes it)."""
        return self._link

    @property
    def address(self) -> str:
        """``HOST:PORT`` the relay listens on (the port bound when ``listen`` asked for 0)."""
        host = self.listen[0]
        return f"[{host}]:{self._port}" if ":" in host else f"{host}:{self._port}"

    @property
    def connections_open(self) -> int:
        """Connections open now (a blackhole's stalled new ones included)."""
        return len(self._conns)

    @property
    def partitioned(self) -> str | None:
        """The partition mode in force, or ``None``."""
        return self._mode

    def start(self) -> "WanRelay":
        """Binds and starts forwarding in a background thread.

        Raises:
            OSError: the address cannot be bound (in use, not local).
            RuntimeError: already started.
        """
        if self._thread is not None:
            raise RuntimeError("WanRelay.start(): already started")
        host, port = self.listen
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=128)
        self._port = sock.getsockname()[1]
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._healed = asyncio.Event()
        if self._mode is None:
            self._healed.set()
        self._thread = threading.Thread(
            target=loop.run_forever, name=f"fedgrid-wan-{self._port}", daemon=True
        )
        self._thread.start()

        async def serve() -> asyncio.AbstractServer:
            return await asyncio.start_server(self._handle, sock=sock, limit=READ_BYTES)

        self._server = self._call(serve())
        log.info("WAN relay %s -> %s:%s: %s", self.address, *self.target, self._link.describe())
        return self

    def stop(self) -> None:
        """Stops listening and closes every connection (reset). Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [c.task for c in self._conns.values() if c.task is not None]
            for conn in list(self._conns.values()):
                conn.reset()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self._call(shutdown())
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(CONTROL_TIMEOUT_S)
            if not thread.is_alive():
                loop.close()
            self._loop = self._thread = None

    def set_link(self, link: WanLink) -> None:
        """Changes the link from now on (pieces already scheduled keep their times)."""
        self._link = link
        log.info("WAN relay %s: link now %s", self.address, link.describe())

    def partition(self, mode: str = "blackhole") -> None:
        """Cuts the link: ``"blackhole"`` holds everything (connections stay open and new ones
        stall), ``"reset"`` resets every connection and every new one until ``heal()``.

        Raises:
            ConfigError: an unknown mode.
        """
        if mode not in PARTITION_MODES:
            raise ConfigError("partition", f"mode is one of {', '.join(PARTITION_MODES)}, not {mode!r}")

        async def cut() -> None:
            self._mode = mode
            self._healed.clear()
            if mode == "reset":
                for conn in list(self._conns.values()):
                    conn.reset()
                    if conn.task is not None:
                        conn.task.cancel()

        self._call(cut())
        log.info("WAN relay %s: partitioned (%s)", self.address, mode)

    def heal(self) -> None:
        """Ends a partition: what a blackhole held is delivered, new connections go through."""

        async def mend() -> None:
            self._mode = None
            self._healed.set()

        self._call(mend())
        log.info("WAN relay %s: healed", self.address)

    def __enter__(self) -> "WanRelay":
        return self.start() if self._thread is None else self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- inside the relay's loop ---------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            coro.close()
            raise RuntimeError("WanRelay: not started")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(CONTROL_TIMEOUT_S)

    async def _passable(self) -> None:
        if not self._healed.is_set():
            await self._healed.wait()

    def _count(self, up: bool, n: int) -> None:
        if up:
            self.bytes_up += n
        else:
            self.bytes_down += n

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._forward(reader, writer)
        except asyncio.CancelledError:
            # Cancelled by a reset partition or stop(): the end of this connection, not an error
            # (asyncio's streams would log a cancelled handler task as "exception in callback").
            pass

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._mode == "reset" or len(self._conns) >= self.max_connections:
            if self._mode != "reset":
                log.warning(
                    "WAN relay %s: %d connections open (max_connections): one more reset",
                    self.address,
                    len(self._conns),
                )
            self.connections_refused += 1
            _reset(writer)
            return
        index = self.connections_total
        self.connections_total += 1
        conn = _Connection(index, writer, asyncio.current_task())
        self._conns[index] = conn
        try:
            await self._passable()  # a blackhole: accepted, then silence (no SYN reaches the target)
            host, port = self.target
            try:
                target_reader, target = await asyncio.wait_for(
                    asyncio.open_connection(host, port, limit=READ_BYTES), CONNECT_TIMEOUT_S
                )
            except (OSError, asyncio.TimeoutError) as exc:
                log.warning(
                    "WAN relay %s: cannot reach the target %s:%s (%s): connection reset",
                    self.address,
                    host,
                    port,
                    exc or "timeout",
                )
                conn.reset()
                return
            conn.target = target
            seed = self._link.seed
            up = LinkClock(random.Random(f"{seed}/{index}/up"), self._lines[True])
            down = LinkClock(random.Random(f"{seed}/{index}/down"), self._lines[False])
            pipes = [_Pipe(self, reader, target, up, True), _Pipe(self, target_reader, writer, down, False)]
            tasks = [asyncio.ensure_future(c) for p in pipes for c in (p.pump(), p.deliver())]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                if any(
                    t.exception() is not None for t in done
                ):  # a peer reset or vanished: so does the other
                    conn.reset()
                else:
                    writer.close()
                    target.close()
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._conns.pop(index, None)


def parse_hostport(value: str, *, key: str = "address") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as ``(host, port)``.

    Raises:
        ConfigError: no port, or a port outside 0-65535 (``key`` named).
    """
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(key, f"expected HOST:PORT, not {value!r}")
    return host.strip("[]"), int(port)
