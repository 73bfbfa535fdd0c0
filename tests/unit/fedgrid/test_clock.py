"""``fedgrid.clock``: the real clock, and the manual one tests drive (it wakes waiters when advanced)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fedgrid.clock import MONOTONIC, Clock, ManualClock, MonotonicClock

from clocked import asleep


def test_both_clocks_are_clocks():
    clocks: list[Clock] = [MONOTONIC, ManualClock()]  # mypy checks the protocol here
    assert isinstance(clocks[0], MonotonicClock)
    a = MONOTONIC.now()
    assert MONOTONIC.now() >= a


def test_a_manual_clock_moves_only_when_advanced():
    clock = ManualClock(start=10.0)
    assert clock.now() == 10.0 and clock.now() == 10.0
    assert clock.advance(2.5) == 12.5 and clock.now() == 12.5
    assert clock.advance(0) == 12.5


@pytest.mark.parametrize("seconds", [-0.001, float("nan"), float("inf")])
def test_a_bad_advance_is_refused_and_changes_nothing(seconds):
    clock = ManualClock(start=1.0)
    with pytest.raises(ValueError, match="a clock advances by a finite number of seconds at least 0"):
        clock.advance(seconds)
    assert clock.now() == 1.0


def test_advance_wakes_thread_waiters_in_deadline_order():
    clock = ManualClock()
    lock = threading.RLock()
    woke: list[tuple[str, float]] = []

    def waiter(name: str, deadline: float) -> None:
        cond = threading.Condition(lock)  # one each, as Wakeups has: a ring wakes its waiter only
        with cond:
            clock.wait_until(cond, deadline)
            woke.append((name, clock.now()))

    threads = [
        threading.Thread(target=waiter, args=(name, at), daemon=True)
        for name, at in (("late", 3.0), ("early", 1.0))
    ]
    for t in threads:
        t.start()
    asleep(clock, 2)
    assert clock.deadlines() == [1.0, 3.0]
    clock.advance(0.75)
    assert clock.sleepers() == 2 and woke == []
    clock.advance(0.25)  # reaches 1.0: the early one only
    threads[1].join(timeout=10)
    assert woke == [("early", 1.0)] and clock.deadlines() == [3.0]
    clock.advance(5.0)
    threads[0].join(timeout=10)
    assert woke == [("early", 1.0), ("late", 6.0)] and clock.sleepers() == 0


def test_a_notified_waiter_leaves_no_alarm_behind():
    clock = ManualClock()
    cond = threading.Condition(threading.RLock())
    done = threading.Event()

    def waiter() -> None:
        with cond:
            clock.wait_until(cond, 60.0)
        done.set()

    threading.Thread(target=waiter, daemon=True).start()
    asleep(clock)
    with cond:
        cond.notify_all()
    assert done.wait(10)
    assert clock.sleepers() == 0 and clock.now() == 0.0


def test_async_waits_end_at_the_deadline_or_with_their_future():
    clock = ManualClock()

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        times = []
        timed = asyncio.ensure_future(clock.wait_until_async(loop.create_future(), 2.0))
        await asyncio.to_thread(asleep, clock)  # the waiter runs up to its sleep meanwhile
        assert clock.deadlines() == [2.0]
        clock.advance(2.0)
        await timed
        times.append(clock.now())
        fut = loop.create_future()
        woken = asyncio.ensure_future(clock.wait_until_async(fut, 100.0))
        await asyncio.to_thread(asleep, clock)
        fut.set_result(None)
        await woken
        times.append(clock.now())
        await clock.wait_until_async(loop.create_future(), 1.0)  # already past: returns at once
        return times

    assert asyncio.run(main()) == [2.0, 2.0]
    assert clock.sleepers() == 0
