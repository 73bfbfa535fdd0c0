"""``--min-clients`` counts the clients present: a benched client (alive, but it missed a
deadline) is one of them, so it never blocks the round, and it is not asked until it
finishes its late task. The fleet's clock is the test's (``clocked.py``): deadlines pass when it
is advanced, and the test asserts on that logical time."""

from __future__ import annotations

from datetime import timedelta

import pytest

from fedgrid.clock import ManualClock
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.types import ClientInfo, FitIns

from clocked import run_out


def _bench_one(small_state) -> tuple[RemoteFleet, ManualClock, dict[str, tuple[ClientInfo, str]]]:
    """A fleet of three (heartbeating) clients, "slow" benched after missing round 1's deadline."""
    clock = ManualClock()
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60), clock=clock)
    joined = {n: fleet.join(ClientInfo(client_id="", name=n, num_examples=1)) for n in ("a", "b", "slow")}
    outcome = run_out(
        clock,
        lambda: fleet.fit_round(
            server_round=1,
            global_state=small_state,
            assignments=[(joined["slow"][0], FitIns(round=1))],
            timeout=timedelta(seconds=30),
        ),
    )
    assert outcome.closed_by == "deadline" and [f.client.name for f in outcome.failures] == ["slow"]
    assert clock.now() == 30.0  # closed at its deadline, not before
    fleet.committed(1)
    return fleet, clock, joined


def test_min_clients_equal_to_the_fleet_with_one_benched_client_runs_the_round(small_state):
    fleet, _, joined = _bench_one(small_state)
    try:
        # Today's main timed out here: "2 live clients after 5s, need 3 (1 more benched ...)".
        chosen = fleet.wait_for_clients(min_clients=3, timeout=timedelta(seconds=5))
        assert sorted(c.name for c in chosen) == ["a", "b"]  # the benched one is not asked
        # Once it shows it finished its late task (here: a failure report), it is asked again.
        slow, token = joined["slow"]
        with pytest.raises(Exception, match="closed"):
            fleet.report_failure(slow.client_id, token, f"{fleet.run_id[:12]}-r1-fit", "out of memory")
        chosen = fleet.wait_for_clients(min_clients=3, timeout=timedelta(seconds=5))
        assert sorted(c.name for c in chosen) == ["a", "b", "slow"]
    finally:
        fleet.close()


def test_min_clients_still_counts_heads(small_state):
    fleet, clock, _ = _bench_one(small_state)
    try:
        with pytest.raises(
            TimeoutError,
            match=r"^3 live clients after 5s, need 4 \(1 of them benched after missing a deadline\)$",
        ):
            run_out(clock, lambda: fleet.wait_for_clients(min_clients=4, timeout=timedelta(seconds=5)))
        assert clock.now() == 35.0  # it waited its 5 s
    finally:
        fleet.close()
