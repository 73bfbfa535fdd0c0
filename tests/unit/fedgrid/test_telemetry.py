"""A round's goodput from its fit results (telemetry.py): sums and a ratio of sums."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from fedgrid.telemetry import goodput_metrics
from fedgrid.types import ClientInfo, FitRes


def _res(name: str, region: str, examples: int, wall: float, compute: float, comm: float) -> FitRes:
    split = {
        "wall_s": wall,
        "compute_s": compute,
        "comm_s": comm,
        "wait_s": wall - compute - comm,
        "transfer_s": comm + 1.0,
        "utilization": compute / wall,
    }
    info = ClientInfo(f"id-{name}", name=name, region=region, num_examples=examples)
    return FitRes(info, OrderedDict(), examples, {"loss": 0.5, **split})


def test_round_sums_the_seconds_and_takes_the_ratio_of_sums():
    results = [
        _res("a", "eu", 1000, wall=10.0, compute=9.0, comm=0.5),
        _res("b", "eu", 10, wall=30.0, compute=3.0, comm=20.0),
        _res("c", "us", 10, wall=20.0, compute=10.0, comm=4.0),
        FitRes(ClientInfo("id-old", name="old", region="us"), OrderedDict(), 5, {"loss": 1.0}),  # no split
    ]
    got = goodput_metrics(results)
    assert got == {
        "compute_s": 22.0,
        "comm_s": 24.5,
        "wait_s": 13.5,
        "transfer_s": 27.5,
        "worker_wall_s": 60.0,
        "utilization": 22.0 / 60.0,
        "utilization.eu": 12.0 / 40.0,
        "utilization.us": 10.0 / 20.0,
    }
    # Not the example-weighted mean of the clients' utilizations (client a's 0.9 would dominate).
    assert got["utilization"] != pytest.approx((1000 * 0.9 + 10 * 0.1 + 10 * 0.5) / 1020)


def test_a_round_without_splits_adds_nothing():
    assert goodput_metrics([]) == {}
    assert goodput_metrics([FitRes(ClientInfo("x", name="x"), OrderedDict(), 1, {"loss": 0.1})]) == {}


def test_the_order_of_results_does_not_change_the_bits():
    results = [_res(n, "", 1, wall=0.1 * i + 0.3, compute=0.1 * i, comm=0.2) for i, n in enumerate("abcdefg")]
    assert goodput_metrics(results) == goodput_metrics(list(reversed(results)))
