"""An upload's frames, read on the event loop and checked on an executor thread.

The servicer (``server/service.py``) reads an upload's header on the loop, then hands the
rest of the stream to ``StreamReader``: the thread checking and spilling the frames
(``server/uploads.py``) takes them from it as a plain iterator.
"""

from __future__ import annotations

import asyncio
import queue
from typing import AsyncIterator, Iterator

__all__ = ["StreamReader", "READ_AHEAD_FRAMES"]

_END = object()
_CANCELLED = object()

#: Upload frames the event loop reads ahead of the thread checking them (per stream).
READ_AHEAD_FRAMES = 4


class StreamReader:
    """Hands an upload's frames, read on the event loop, to the executor thread checking them.

    A task on the loop reads up to ``READ_AHEAD_FRAMES`` frames ahead into a queue the thread
    takes them from; it waits while the queue is full (backpressure), and the two threads
    wake each other only at those edges, not once per frame (a round trip through the loop
    per 1 MiB frame cost more than checking the frame). A stream that sends nothing for
    ``STREAM_IDLE_S`` ends with ``TimeoutError``, and ``close`` (the RPC was cancelled) ends it
    at once with ``ConnectionError``: either way the fleet keeps what was verified so that
    the client resumes from there.
    """

    def __init__(self, it: AsyncIterator[bytes], loop: asyncio.AbstractEventLoop, idle_s: float) -> None:
        self.it, self.loop, self.idle_s = it, loop, idle_s
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._room = asyncio.Event()  # set while the queue has room; changed on the loop only
        self._room.set()
        self._closed = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts reading ahead (on the loop)."""
        self._task = self.loop.create_task(self._pump())

    def close(self) -> None:
        """Stops reading; the thread checks the frames already received, then raises
        ``ConnectionError`` (so the client resumes after every frame that arrived whole)."""
        self._closed = True
        self._queue.put(_CANCELLED)  # after the queued frames; wakes a thread waiting for one
        if self._task is not None:
            self._task.cancel()

    async def _pump(self) -> None:
        try:
            while not self._closed:
                if self._queue.qsize() >= READ_AHEAD_FRAMES:
                    self._room.clear()
                    if self._queue.qsize() >= READ_AHEAD_FRAMES:  # the thread takes, then looks at _room
                        await self._room.wait()
                    continue
                self._queue.put(await self.it.__anext__())  # type: ignore[attr-defined]
        except StopAsyncIteration:
            self._queue.put(_END)
        except Exception as exc:  # the stream broke: the thread raises it
            self._queue.put(ConnectionError(f"the upload stream broke: {exc!r}"))

    def frames(self, first: bytes) -> Iterator[bytes]:
        yield first
        while True:
            try:
                item = self._queue.get(timeout=self.idle_s)
            except queue.Empty:
                raise TimeoutError(f"upload stream idle for {self.idle_s:g}s") from None
            if item is _CANCELLED:
                raise ConnectionError("the upload stream was cancelled")
            if not self._room.is_set():
                self.loop.call_soon_threadsafe(self._room.set)
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
