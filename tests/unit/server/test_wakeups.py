"""Keyed wake-ups: a notify wakes the waiters of its key only, threads and asyncio alike; a wait
ends at its deadline on the fleet's clock."""

from __future__ import annotations

import asyncio
import threading

from fedgrid.clock import MONOTONIC, ManualClock
from fedgrid.server.wakeups import Wakeups

from clocked import asleep


def test_notify_wakes_only_its_key():
    lock = threading.RLock()
    clock = ManualClock()
    wake = Wakeups(lock, clock=clock)
    woke: dict[str, float] = {}

    entered = {k: threading.Event() for k in ("a", "b")}

    def waiter(key: str) -> None:
        with lock:
            entered[key].set()  # the lock is released only inside wait, once registered
            wake.wait_until(key, 30.0)
            woke[key] = clock.now()

    threads = {k: threading.Thread(target=waiter, args=(k,), daemon=True) for k in ("a", "b")}
    for t in threads.values():
        t.start()
    assert all(e.wait(10) for e in entered.values())
    with lock:  # acquired once both waiters sleep, registered
        assert wake.waiting("a") == 1 and wake.waiting("b") == 1
    assert clock.deadlines() == [30.0, 30.0]
    with lock:
        wake.notify("a")
    threads["a"].join(timeout=10)
    assert woke == {"a": 0.0}  # woken by its key, at logical time 0; b still asleep
    with lock:
        assert wake.waiting("b") == 1 and wake.waiting("a") == 0
        wake.notify_all()
    threads["b"].join(timeout=10)
    assert woke == {"a": 0.0, "b": 0.0} and clock.sleepers() == 0


def test_wait_ends_at_its_deadline_and_reentrant_lock_is_restored():
    lock = threading.RLock()
    clock = ManualClock(start=100.0)
    wake = Wakeups(lock, clock=clock)
    woke: list[float] = []

    def waiter() -> None:
        with lock, lock:  # held twice: the wait releases both levels and restores them
            wake.wait_until("k", 100.5)
            woke.append(clock.now())
            assert wake.waiting("k") == 0

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    asleep(clock)
    clock.advance(0.25)  # before its deadline: it sleeps on
    assert clock.sleepers() == 1 and not woke
    clock.advance(0.25)
    thread.join(timeout=10)
    assert woke == [100.5]
    assert lock.acquire(blocking=False)  # fully released after the with blocks
    lock.release()


def test_a_deadline_already_reached_returns_at_once():
    lock = threading.RLock()
    clock = ManualClock(start=5.0)
    wake = Wakeups(lock, clock=clock)
    with lock:
        wake.wait_until("k", 5.0)  # no thread to wake it: returning proves it never slept
        assert wake.waiting("k") == 0 and clock.sleepers() == 0


def test_async_waiter_is_woken_from_another_thread():
    lock = threading.RLock()
    clock = ManualClock()
    wake = Wakeups(lock, clock=clock)
    state = {"ready": False}

    checked = threading.Event()

    def ready() -> bool:  # called holding the lock, just before the waiter registers
        checked.set()
        return state["ready"]

    async def main() -> float:
        def notifier() -> None:
            assert checked.wait(10)
            with lock:  # acquired once the waiter registered and released it
                assert wake.waiting("poll") == 1
                state["ready"] = True
                wake.notify("poll")

        t = threading.Thread(target=notifier)
        t.start()
        await wake.wait_until_async("poll", 30.0, ready)
        t.join()
        return clock.now()

    assert asyncio.run(main()) == 0.0  # woken by the notify, not by its deadline
    assert wake.waiting("poll") == 0 and clock.sleepers() == 0


def test_async_waiter_returns_at_once_when_ready_and_at_its_deadline():
    clock = ManualClock()
    wake = Wakeups(threading.RLock(), clock=clock)

    async def main() -> list[float]:
        await wake.wait_until_async("k", 30.0, lambda: True)
        at = [clock.now()]
        waiter = asyncio.ensure_future(wake.wait_until_async("k", 0.05, lambda: False))
        await asyncio.to_thread(asleep, clock)  # the waiter runs up to its sleep meanwhile
        clock.advance(0.05)
        await waiter
        return [*at, clock.now()]

    assert asyncio.run(main()) == [0.0, 0.05]
    assert wake.waiting("k") == 0 and clock.sleepers() == 0


def test_the_real_clock_times_waits_out_in_real_seconds():
    """A run's clock (``MONOTONIC``): what the fleet does outside tests."""
    lock = threading.RLock()
    wake = Wakeups(lock)
    assert wake.clock is MONOTONIC
    with lock:
        start = MONOTONIC.now()
        wake.wait_until("k", start + 0.05)
        assert MONOTONIC.now() - start >= 0.04 and wake.waiting("k") == 0

    async def main() -> float:
        start = MONOTONIC.now()
        await wake.wait_until_async("k", start + 0.05, lambda: False)
        return MONOTONIC.now() - start

    assert asyncio.run(main()) >= 0.04
