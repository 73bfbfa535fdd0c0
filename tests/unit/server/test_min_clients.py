"""``--min-clients`` counts the clients present: a benched client (alive, but it missed a
deadline) is one of them, so it never blocks the round, and it is not asked until it
finishes its late task."""

from __future__ import annotations

from datetime import timedelta

import pytest

from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.types import ClientInfo, FitIns


def _bench_one(small_state) -> tuple[RemoteFleet, dict[str, tuple[ClientInfo, str]]]:
    """A fleet of three (heartbeating) clients, "slow" benched after missing round 1's deadline."""
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    joined = {n: fleet.join(ClientInfo(client_id="", name=n, num_examples=1)) for n in ("a", "b", "slow")}
    outcome = fleet.fit_round(
        server_round=1,
        global_state=small_state,
        assignments=[(joined["slow"][0], FitIns(round=1))],
        timeout=timedelta(seconds=0.2),
    )
    assert outcome.closed_by == "deadline" and [f.client.name for f in outcome.failures] == ["slow"]
    fleet.committed(1)
    return fleet, joined


def test_min_clients_equal_to_the_fleet_with_one_benched_client_runs_the_round(small_state):
    fleet, joined = _bench_one(small_state)
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
    fleet, _ = _bench_one(small_state)
    try:
        with pytest.raises(
            TimeoutError,
            match=r"^3 live clients after 0s, need 4 \(1 of them benched after missing a deadline\)$",
        ):
            fleet.wait_for_clients(min_clients=4, timeout=timedelta(seconds=0.1))
    finally:
        fleet.close()
