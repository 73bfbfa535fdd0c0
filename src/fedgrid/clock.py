"""Time for the coordinator's fleet: a clock it reads and waits on, so that a test can drive it.

The fleet's decisions in time (a round's deadline, a quorum's grace, a session's silence, a long
poll's wait, waiting for clients, a restart's grace) read ``Clock.now`` and block through the
clock: ``wait_until`` for a thread on a ``threading.Condition``, ``wait_until_async`` for an
asyncio task on a future. Both take an absolute deadline in the clock's own time, so that a
waiter's deadline does not move while it computes it.

``MONOTONIC`` (a ``MonotonicClock``) is ``time.monotonic`` and the plain blocking calls: what a
run uses. ``ManualClock`` stands still until a test calls ``advance``, which wakes every waiter
whose deadline it reached, in deadline order: the test asserts on logical time and takes none.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

__all__ = ["Clock", "MonotonicClock", "ManualClock", "MONOTONIC"]


class Clock(Protocol):
    """Seconds that only go forward, and waits bounded in them."""

    def now(self) -> float:
        """The current time, in seconds (only differences mean anything)."""
        ...

    def wait_until(self, cond: threading.Condition, deadline: float) -> None:
        """Blocks on ``cond`` (its lock held) until it is notified or ``now()`` reaches
        ``deadline``; may return early (callers check their condition again)."""
        ...

    async def wait_until_async(self, fut: asyncio.Future[Any], deadline: float) -> None:
        """Awaits ``fut`` until it is done or ``now()`` reaches ``deadline`` (returns either way)."""
        ...


class MonotonicClock:
    """The real clock: ``time.monotonic``, and waits that time out in real seconds."""

    def now(self) -> float:
        return time.monotonic()

    def wait_until(self, cond: threading.Condition, deadline: float) -> None:
        cond.wait(max(0.0, deadline - time.monotonic()))

    async def wait_until_async(self, fut: asyncio.Future[Any], deadline: float) -> None:
        try:
            await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            pass


#: The clock of every run (a fleet's default).
MONOTONIC = MonotonicClock()


@dataclass(order=True)
class _Alarm:
    at: float
    seq: int
    ring: Callable[[], None] = field(compare=False)


class ManualClock:
    """A clock that moves only when ``advance`` is called (for tests).

    A waiter registers an alarm at its deadline and blocks with no real timeout; ``advance``
    rings the alarms it passes, so a test waits for the waiter to be asleep (``sleepers``),
    advances, and the waiter wakes at once.

    Args:
        start: the time ``now`` returns before any ``advance``.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._lock = threading.Lock()
        self._alarms: list[_Alarm] = []
        self._seq = 0

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        """Moves the clock ``seconds`` forward and wakes the waiters whose deadline it reached,
        earliest first; returns the new time.

        Raises:
            ValueError: ``seconds`` is negative or not finite (the clock is left as it was).
        """
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"a clock advances by a finite number of seconds at least 0, got {seconds}")
        with self._lock:
            self._now += seconds
            due = sorted(a for a in self._alarms if a.at <= self._now)
            self._alarms = [a for a in self._alarms if a.at > self._now]
            now = self._now
        for alarm in due:
            alarm.ring()
        return now

    def sleepers(self) -> int:
        """How many waiters are asleep on this clock (a test advances once they are)."""
        with self._lock:
            return len(self._alarms)

    def deadlines(self) -> list[float]:
        """The deadlines the sleeping waiters wait for, earliest first."""
        with self._lock:
            return sorted(a.at for a in self._alarms)

    def wait_until(self, cond: threading.Condition, deadline: float) -> None:
        def ring() -> None:
            with cond:
                cond.notify_all()

        alarm = self._set(deadline, ring)
        if alarm is None:
            return
        try:
            cond.wait()
        finally:
            self._cancel(alarm)

    async def wait_until_async(self, fut: asyncio.Future[Any], deadline: float) -> None:
        loop = asyncio.get_running_loop()
        timer: asyncio.Future[None] = loop.create_future()

        def resolve() -> None:
            if not timer.done():
                timer.set_result(None)

        def ring() -> None:
            try:
                loop.call_soon_threadsafe(resolve)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        alarm = self._set(deadline, ring)
        if alarm is None:
            return
        try:
            await asyncio.wait((fut, timer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._cancel(alarm)
            timer.cancel()

    def _set(self, deadline: float, ring: Callable[[], None]) -> _Alarm | None:
        """An alarm at ``deadline``, or ``None`` when the clock already reached it."""
        with self._lock:
            if deadline <= self._now:
                return None
            self._seq += 1
            alarm = _Alarm(deadline, self._seq, ring)
            self._alarms.append(alarm)
            return alarm

    def _cancel(self, alarm: _Alarm) -> None:
        with self._lock:
            if alarm in self._alarms:
                self._alarms.remove(alarm)
