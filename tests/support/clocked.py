"""Tests drive the fleet's time: a ``fedgrid.clock.ManualClock`` moves only when a test moves it.

A fleet built with ``clock=ManualClock()`` decides deadlines, grace windows and silence in the
clock's time, and its waits end when the clock is advanced past them. A blocking fleet call
(``fit_round``, ``wait_for_clients``) runs on a thread of its own (``Call``); the test waits until
it sleeps on the clock (``asleep``), then advances it, or lets ``run_out`` jump the clock from one
deadline to the next until the call returns. Assertions then name logical seconds
(``clock.now() == 30.0``), and no test waits for them to pass.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Generic, TypeVar

from fedgrid.clock import ManualClock

from harness import wait_until

__all__ = ["Call", "asleep", "run_out"]

T = TypeVar("T")


class Call(Generic[T]):
    """``fn()`` on a daemon thread; ``result`` returns what it returned or raises what it raised."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._value: list[T] = []
        self._error: list[BaseException] = []

        def run() -> None:
            try:
                self._value.append(fn())
            except BaseException as exc:  # handed to the test by result()
                self._error.append(exc)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def result(self, timeout: float = 10.0) -> T:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the call did not return within {timeout} s"
        if self._error:
            raise self._error[0]
        return self._value[0]


def asleep(clock: ManualClock, sleepers: int = 1, *, timeout: float = 10.0) -> None:
    """Returns once ``sleepers`` waiters sleep on ``clock`` (fails the test after ``timeout`` real s)."""
    wait_until(lambda: clock.sleepers() >= sleepers, timeout=timeout, what=f"{sleepers} waiters on the clock")


def run_out(clock: ManualClock, fn: Callable[[], T], *, timeout: float = 30.0) -> T:
    """Runs ``fn()`` on a thread and, whenever something sleeps on ``clock``, advances the clock to
    the earliest deadline, until ``fn`` returns; returns its result (raises its exception).

    Only for calls that nothing else wakes: the clock jumps as soon as a waiter sleeps.
    """
    call = Call(fn)
    give_up = time.monotonic() + timeout  # real seconds: a bound on the test, not on the fleet
    while not call.done():
        if time.monotonic() > give_up:
            raise AssertionError(f"the call did not return within {timeout} real s")
        due = clock.deadlines()
        if due:
            clock.advance(max(0.0, due[0] - clock.now()))
        call.join(0.005)
    return call.result()
