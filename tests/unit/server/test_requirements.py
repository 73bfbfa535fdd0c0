"""The coordinator's capability requirements: built from the configuration, applied by the fleet before any strategy sees a client."""

from __future__ import annotations

from datetime import timedelta

import pytest

from fedgrid.aggregation.selection import CapabilityFilter
from fedgrid.clock import ManualClock
from fedgrid.config import load_config
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.strategies import build_capability_filter
from fedgrid.types import ClientInfo

from clocked import run_out


def test_requirements_come_from_the_three_keys():
    assert build_capability_filter(load_config()) is None  # the defaults ask nothing
    got = build_capability_filter(
        load_config(overrides={"require_device": "cuda", "min_accelerators": 2, "min_client_memory": "40GiB"})
    )
    assert got is not None and (got.devices, got.min_accelerators, got.min_memory_bytes) == (
        ("cuda",),
        2,
        40 << 30,
    )
    only_memory = build_capability_filter(load_config(overrides={"min_client_memory": "1GB"}))
    assert only_memory is not None and (only_memory.devices, only_memory.min_memory_bytes) == ((), 10**9)


def test_the_fleet_waits_for_qualifying_clients_and_returns_only_them():
    clock = ManualClock()
    fleet = RemoteFleet(
        heartbeat_interval=timedelta(seconds=60),
        requirements=CapabilityFilter(devices=("cuda",), min_memory_bytes=8 << 30),
        clock=clock,
    )
    try:
        fleet.join(ClientInfo("", name="cpu", memory_bytes=64 << 30))
        small, _ = fleet.join(
            ClientInfo("", name="small", device="cuda", num_accelerators=1, memory_bytes=4 << 30)
        )
        with pytest.raises(TimeoutError) as info:
            run_out(clock, lambda: fleet.wait_for_clients(min_clients=1, timeout=timedelta(seconds=5)))
        assert (
            str(info.value) == "0 live clients after 5s, need 1 (2 more short of the capability requirements)"
        )
        assert clock.now() == 5.0
        big, _ = fleet.join(
            ClientInfo("", name="big", device="cuda", num_accelerators=1, memory_bytes=80 << 30)
        )
        assert fleet.wait_for_clients(min_clients=1, timeout=timedelta(seconds=5)) == [big]
        assert {c.name for c in fleet.live_clients()} == {"cpu", "small", "big"}  # the others stay registered
    finally:
        fleet.close()
