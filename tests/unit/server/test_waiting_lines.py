"""The "waiting for N clients" line stays under the log budget: a flood of Joins writes a line
when the count has moved by a tenth of N, and otherwise one every ``WAITING_REPORT_S`` on the
fleet's clock (``clocked.py``: the test moves time, nothing sleeps)."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest

from fedgrid.clock import ManualClock
from fedgrid.constants import WAITING_REPORT_S
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.types import ClientInfo

from clocked import Call, asleep
from harness import wait_until


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for")]


def test_a_join_flood_writes_a_line_per_tenth_of_the_target_and_one_per_interval(caplog):
    caplog.set_level(logging.INFO, logger="fedgrid")
    clock = ManualClock()
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=3600), clock=clock)
    call = Call(lambda: fleet.wait_for_clients(min_clients=1000, timeout=timedelta(seconds=600)))
    asleep(clock)
    for i in range(500):
        fleet.join(ClientInfo("", name=f"c{i}", num_examples=1))
        if i % 5 == 4:  # let the waiter see the count move, as a real flood would
            wait_until(lambda: clock.sleepers() >= 1, timeout=10, what="the waiter back asleep")
    asleep(clock)
    flood = _lines(caplog)
    counts = [int(line.split("(")[1].split()[0]) for line in flood]
    # 0, then one line per 100 joins at most: six lines for 500 Joins, not one a Join.
    assert counts[0] == 0 and len(counts) <= 6, flood
    assert all(b - a >= 100 for a, b in zip(counts, counts[1:])), flood
    clock.advance(WAITING_REPORT_S - 0.5)
    asleep(clock)
    assert _lines(caplog) == flood  # nothing new before the interval
    clock.advance(0.5)
    wait_until(lambda: len(_lines(caplog)) == len(flood) + 1, timeout=10, what="the interval's line")
    assert _lines(caplog)[-1] == "waiting for 1000 clients (500 joined)"
    clock.advance(600)
    with pytest.raises(TimeoutError):
        call.result()
    fleet.close()
