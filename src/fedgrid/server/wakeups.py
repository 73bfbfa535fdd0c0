"""Keyed wake-ups under one lock: an event wakes only the waiters it concerns.

The coordinator's state lives under one lock. A waiter (a long poll, the round loop, an
upload-status query) checks its condition holding the lock, and when it must wait it
registers under a key (``("poll", client_id)``, ``"round"``, ...) before releasing the
lock; a notifier changes state holding the lock and wakes that key's waiters only. So a
task for one client wakes that client's poll, not the thousands of others, and no wake-up
is lost between the check and the sleep.

Threads wait on a ``threading.Condition`` sharing the lock; asyncio tasks wait on a future
of their own loop, resolved thread-safely. Waits end at a deadline of the fleet's clock
(``fedgrid.clock``): a test's ``ManualClock`` ends them when it is advanced past it.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from typing import Callable, Hashable

from fedgrid.clock import MONOTONIC, Clock

__all__ = ["Wakeups"]


class Wakeups:
    """Waiters by key, all under ``lock`` (held when registering, waiting and notifying).

    Args:
        lock: the state lock; ``threading.RLock`` so that a waiter may hold it re-entrantly.
        clock: the time waits end in (the fleet's; its collaborators read it here).
    """

    def __init__(self, lock: threading.RLock, *, clock: Clock = MONOTONIC) -> None:
        self.lock = lock
        self.clock = clock
        self._waiters: defaultdict[Hashable, list[Callable[[], None]]] = defaultdict(list)

    def wait_until(self, key: Hashable, deadline: float) -> None:
        """Sleeps until ``key`` is notified or the clock reaches ``deadline`` (call holding the
        lock; it is released while asleep and held again on return)."""
        cond = threading.Condition(self.lock)  # type: ignore[arg-type]
        self._waiters[key].append(cond.notify)
        try:
            self.clock.wait_until(cond, deadline)
        finally:
            self._discard(key, cond.notify)

    async def wait_until_async(self, key: Hashable, deadline: float, ready: Callable[[], bool]) -> None:
        """Awaits until ``ready()`` (checked holding the lock) holds, ``key`` is notified, or
        the clock reaches ``deadline``; call it without holding the lock."""
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
            await self.clock.wait_until_async(fut, deadline)
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
