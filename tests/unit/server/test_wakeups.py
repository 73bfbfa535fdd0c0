"""Keyed wake-ups: a notify wakes the waiters of its key only, threads and asyncio alike."""

from __future__ import annotations

import asyncio
import threading
import time

from fedgrid.server.wakeups import Wakeups


def test_notify_wakes_only_its_key():
    lock = threading.RLock()
    wake = Wakeups(lock)
    woke: dict[str, float] = {}

    entered = {k: threading.Event() for k in ("a", "b")}

    def waiter(key: str) -> None:
        with lock:
            entered[key].set()  # the lock is released only inside wait, once registered
            start = time.monotonic()
            wake.wait(key, 30.0)
            woke[key] = time.monotonic() - start

    threads = {k: threading.Thread(target=waiter, args=(k,)) for k in ("a", "b")}
    for t in threads.values():
        t.start()
    assert all(e.wait(10) for e in entered.values())
    with lock:  # acquired once both waiters sleep, registered
        assert wake.waiting("a") == 1 and wake.waiting("b") == 1
    with lock:
        wake.notify("a")
    threads["a"].join(timeout=10)
    assert "a" in woke and woke["a"] < 10 and "b" not in woke  # b still asleep
    with lock:
        assert wake.waiting("b") == 1 and wake.waiting("a") == 0
        wake.notify_all()
    threads["b"].join(timeout=10)
    assert "b" in woke


def test_wait_times_out_and_reentrant_lock_is_restored():
    lock = threading.RLock()
    wake = Wakeups(lock)
    with lock, lock:  # held twice: the wait releases both levels and restores them
        start = time.monotonic()
        wake.wait("k", 0.05)
        assert time.monotonic() - start >= 0.04
        assert wake.waiting("k") == 0
    assert lock.acquire(blocking=False)  # fully released after the with blocks
    lock.release()


def test_async_waiter_is_woken_from_another_thread():
    lock = threading.RLock()
    wake = Wakeups(lock)
    state = {"ready": False}

    checked = threading.Event()

    def ready() -> bool:  # called holding the lock, just before the waiter registers
        checked.set()
        return state["ready"]

    async def main() -> float:
        start = time.monotonic()

        def notifier() -> None:
            assert checked.wait(10)
            with lock:  # acquired once the waiter registered and released it
                assert wake.waiting("poll") == 1
                state["ready"] = True
                wake.notify("poll")

        t = threading.Thread(target=notifier)
        t.start()
        await wake.wait_async("poll", 30.0, ready)
        t.join()
        return time.monotonic() - start

    assert asyncio.run(main()) < 10
    assert wake.waiting("poll") == 0


def test_async_waiter_returns_at_once_when_ready_and_on_timeout():
    wake = Wakeups(threading.RLock())

    async def main() -> tuple[float, float]:
        t0 = time.monotonic()
        await wake.wait_async("k", 30.0, lambda: True)
        t1 = time.monotonic()
        await wake.wait_async("k", 0.05, lambda: False)
        return t1 - t0, time.monotonic() - t1

    ready, timed_out = asyncio.run(main())
    assert ready < 1.0 and 0.04 <= timed_out < 5.0
