"""Keyed wake-ups under one lock: an event wakes only the waiters it concerns.

The coordinator's state lives under one lock. A waiter (a long poll, the round loop, an
upload-status query) checks its condition holding the lock, and when it must wait it
registers under a key (``("poll", client_id)``, ``"round"``, ...) before releasing the
lock; a notifier changes state holding the lock and wakes that key's waiters only. So a
task for one client wakes that client's poll, not the thousands of others, and no wake-up
is lost between the check and the sleep.

Threads wait on a ``threading.Condition`` sharing the lock; asyncio tasks wait on a future
of their own loop, resolved thread-safely.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from typing import Callable, Hashable

__all__ = ["Wakeups"]


class Wakeups:
    """Waiters by key, all under ``lock`` (held when registering, waiting and notifying).

    Args:
        lock: the state lock; ``threading.RLock`` so that a waiter may hold it re-entrantly.
    """

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self._waiters: defaultdict[Hashable, list[Callable[[], None]]] = defaultdict(list)

    def wait(self, key: Hashable, timeout: float) -> None:
        """Sleeps until ``key`` is notified or ``timeout`` seconds pass (call holding the lock;
        it is released while asleep and held again on return)."""
        cond = threading.Condition(self.lock)  # type: ignore[arg-type]
        self._waiters[key].append(cond.notify)
        try:
            cond.wait(max(0.0, timeout))
        finally:
            self._discard(key, cond.notify)

    async def wait_async(self, key: Hashable, timeout: float, ready: Callable[[], bool]) -> None:
        """Awaits until ``ready()`` (checked holding the lock) holds, ``key`` is notified, or
        ``timeout`` seconds pass; call it without holding the lock."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def resolve() -> None:
            if not fut.done():
                fut.set_result(None)

        def wake() -> None:
            loop.call_soon_threadsafe(resolve)

        with self.lock:
            if ready():
                return
            self._waiters[key].append(wake)
        try:
            await asyncio.wait_for(fut, max(0.0, timeout))
        except asyncio.TimeoutError:
            pass
        finally:
            with self.lock:
                self._discard(key, wake)

    def notify(self, *keys: Hashable) -> None:
        """Wakes every waiter of each of ``keys`` (call holding the lock)."""
        for key in keys:
            for wake in self._waiters.pop(key, ()):
                wake()

    def notify_all(self) -> None:
        """Wakes every waiter (a state change that concerns everyone: stop, finish, restore)."""
        waiters, self._waiters = self._waiters, defaultdict(list)
        for wakes in waiters.values():
            for wake in wakes:
                wake()

    def waiting(self, key: Hashable) -> int:
        """How many waiters ``key`` has (for tests)."""
        return len(self._waiters.get(key, ()))

    def _discard(self, key: Hashable, wake: Callable[[], None]) -> None:
        wakes = self._waiters.get(key)
        if wakes is not None:
            try:
                wakes.remove(wake)
            except ValueError:
                pass  # already popped by a notify
            if not wakes:
                del self._waiters[key]
