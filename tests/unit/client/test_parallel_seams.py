"""The class each rank's client becomes (``client/parallel_ranks.distribute``) carries the seams'
flags as well as their methods: a flag left behind would leave the factory's class's value."""

from __future__ import annotations

from fedgrid.client.parallel_ranks import _DistributedSeams, _seam_members
from fedgrid.client.torch_client import TorchClient


def test_the_rank_class_takes_the_seams_flags_and_methods() -> None:
    members = _seam_members()
    distributed = type("DistributedTorchClient", (TorchClient,), members)
    # Inline lookahead, no time budget: the base class says the opposite for both.
    assert TorchClient._background_lookahead is True
    assert distributed._background_lookahead is False
    assert distributed._time_budget_allowed is False
    assert distributed._load is _DistributedSeams._load
    assert not [name for name in members if name.startswith("__")]
