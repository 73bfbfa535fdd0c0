"""``fedgrid.proto.assembly.check_metrics``: what a client reports of its time split is bounded at
the wire (finite, at least 0, utilization at most 1, seconds at most ``MAX_REPORTED_S``), and a
refusal names the field."""

from __future__ import annotations

import math

import pytest

from fedgrid.constants import MAX_REPORTED_S
from fedgrid.errors import InvalidUpdateError
from fedgrid.proto.assembly import check_metrics

SPLIT = {
    "wall_s": 4.0,
    "compute_s": 3.0,
    "comm_s": 0.5,
    "wait_s": 0.5,
    "transfer_s": 1.0,
    "utilization": 0.75,
}


@pytest.mark.parametrize(
    "field, value",
    [
        ("compute_s", 1.7e308),
        ("wall_s", MAX_REPORTED_S * 2),
        ("compute_s", -2e300),
        ("comm_s", -0.5),
        ("utilization", -3.0),
        ("utilization", 1.5),
        ("wait_s", math.inf),
        ("transfer_s", math.nan),
    ],
)
def test_a_split_field_out_of_bounds_is_refused_by_name(field, value):
    with pytest.raises(InvalidUpdateError, match=rf"metric '{field}' is"):
        check_metrics({**SPLIT, field: value})


def test_bounds_hold_at_their_edges_and_spare_the_applications_metrics():
    check_metrics({**SPLIT, "wall_s": MAX_REPORTED_S, "compute_s": 0.0, "utilization": 1.0})
    check_metrics({"loss": -3.5, "reward": -1e300})  # the application's own figures may be negative
    assert MAX_REPORTED_S * 10**6 < 1e300  # a million of them still sum to a finite float
