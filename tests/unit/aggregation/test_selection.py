"""Selection: counts, over-selection and selectors."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from fedgrid.aggregation import FedAvg
from fedgrid.aggregation.selection import (
    CapabilityFilter,
    RegionBalancedSelector,
    Sampling,
    SelectionPolicy,
    UniformSelector,
)
from fedgrid.types import ClientInfo


def _clients(n, regions=("eu", "us", "ap")):
    return [
        ClientInfo(
            client_id=f"id{i}", name=f"c{i:02d}", region=regions[i % len(regions)], memory_bytes=i * 100
        )
        for i in range(n)
    ]


def test_policy_counts():
    assert SelectionPolicy().target(num_live=10, fraction=0.5, minimum=1) == 5
    assert SelectionPolicy(clients_per_round=4).target(num_live=10, fraction=0.1, minimum=1) == 4
    assert SelectionPolicy(clients_per_round=40).target(num_live=10, fraction=0.1, minimum=1) == 10
    policy = SelectionPolicy(clients_per_round=4, over_selection=0.3)
    assert policy.asked(4, 10) == 6  # ceil(4 * 1.3)
    assert policy.asked(4, 5) == 5
    with pytest.raises(ValueError, match="over_selection"):
        SelectionPolicy(over_selection=-0.1)


def test_fedavg_over_selects_and_sets_target():
    strategy = FedAvg(sampling=Sampling(seed=3))
    strategy.initialize(initial_state={"w": torch.zeros(1)})
    strategy.selection = SelectionPolicy(clients_per_round=4, over_selection=0.5)
    clients = _clients(10)
    asked = strategy.configure_round(server_round=1, clients=clients)
    assert len(asked) == 6 and len({c.client_id for c, _ in asked}) == 6
    assert strategy.round_target(num_live=10, num_assigned=len(asked)) == 4
    again = strategy.configure_round(server_round=1, clients=list(reversed(clients)))
    assert [c.client_id for c, _ in again] == [c.client_id for c, _ in asked]  # seeded, order-free
    assert [c.client_id for c, _ in strategy.configure_round(server_round=2, clients=clients)] != [
        c.client_id for c, _ in asked
    ]


def test_region_balanced_covers_every_region_evenly():
    clients = _clients(30)
    for seed in range(20):
        chosen = RegionBalancedSelector().select(clients, 6, random.Random(seed))
        assert len(chosen) == 6 and len(set(chosen)) == 6
        assert Counter(c.region for c in chosen) == {"eu": 2, "us": 2, "ap": 2}
    lopsided = _clients(7, regions=("eu",)) + _clients(1, regions=("us",))
    chosen = RegionBalancedSelector().select(lopsided, 3, random.Random(0))
    assert Counter(c.region for c in chosen)["us"] == 1


def test_capability_filter():
    clients = _clients(10)
    chosen = CapabilityFilter(min_memory_bytes=500, regions=("eu", "us")).select(
        clients, 10, random.Random(0)
    )
    assert sorted(c.name for c in chosen) == ["c06", "c07", "c09"]
    assert UniformSelector().select(clients, 3, random.Random(1)) == UniformSelector().select(
        clients, 3, random.Random(1)
    )


def test_capability_filter_by_device_and_accelerators_says_what_is_missing():
    gpu = ClientInfo("g", name="gpu", device="cuda", num_accelerators=2, memory_bytes=80 << 30)
    small = ClientInfo("s", name="small-gpu", device="cuda", num_accelerators=1, memory_bytes=8 << 30)
    cpu = ClientInfo("c", name="cpu", device="cpu", memory_bytes=512 << 30)
    needs = CapabilityFilter(min_memory_bytes=16 << 30, min_accelerators=1, devices=("cuda",))
    assert needs.select([cpu, gpu, small], 3, random.Random(0)) == [gpu]
    assert needs.shortfall(gpu) is None
    assert needs.shortfall(cpu) == "device 'cpu' is not 'cuda'"
    assert needs.shortfall(small) == f"memory {8 << 30} bytes, less than {16 << 30}"
    assert CapabilityFilter(min_accelerators=2).shortfall(small) == "1 accelerators, fewer than 2"
