"""``fedgrid.aggregation.lora_ranks``: a LoRA pair refactorized to a client's rank is the truncated
SVD of its product (the seeded start, B = 0, keeps A's leading rows), the specs follow, and the
ranks a coordinator takes at Join are checked naming the key."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from fedgrid.aggregation.lora import svd_merge
from fedgrid.aggregation.lora_ranks import RankPolicy, RankViews, adapter_rank, specs_at_rank, state_at_rank
from fedgrid.errors import AdapterRankError
from fedgrid.types import TensorSpec

A, B = "l.lora_A.default.weight", "l.lora_B.default.weight"


def _state(rank: int, zero_b: bool = False) -> OrderedDict:
    g = torch.Generator().manual_seed(rank)
    b = torch.zeros(6, rank) if zero_b else torch.randn(6, rank, generator=g)
    return OrderedDict([(A, torch.randn(rank, 5, generator=g)), (B, b), ("bias", torch.ones(3))])


def test_a_pair_at_a_lower_rank_is_the_truncated_svd_of_its_product():
    state = _state(4)
    small = state_at_rank(state, 2)
    assert small[A].shape == (2, 5) and small[B].shape == (6, 2) and small["bias"] is state["bias"]
    u, s, vh = torch.linalg.svd(state[B].double() @ state[A].double())
    torch.testing.assert_close(
        small[B].double() @ small[A].double(), (u[:, :2] * s[:2]) @ vh[:2], rtol=1e-5, atol=1e-6
    )
    # An svd aggregate is already in SVD form: its leading components are its refactorization.
    a, b = svd_merge([(state[A], state[B])], [1.0], rank=4, scale=1.0)
    again = state_at_rank(OrderedDict([(A, a), (B, b)]), 2)
    torch.testing.assert_close(again[A], a[:2]) and torch.testing.assert_close(again[B], b[:, :2])


def test_the_seeded_start_keeps_the_leading_rows_of_a():
    state = _state(8, zero_b=True)
    small = state_at_rank(state, 3)
    assert torch.equal(small[A], state[A][:3]) and torch.equal(small[B], torch.zeros(6, 3))


def test_specs_and_views_follow_the_rank():
    state = _state(4)
    assert adapter_rank(state) == 4 and adapter_rank({"w": torch.ones(2)}) == 0
    specs = specs_at_rank(TensorSpec.of(state), 2)
    assert specs[A].shape == (2, 5) and specs[B].shape == (6, 2) and specs["bias"].shape == (3,)
    views = RankViews(state)
    assert not views.differs(0) and not views.differs(4) and views.differs(2)
    assert views.at(2) is views.at(2) and views.at(4)[A] is state[A]


@pytest.mark.parametrize(
    ("policy", "rank", "key"),
    [
        (RankPolicy(8, "svd"), 9, "peft_rank"),
        (RankPolicy(0, None), 4, "peft_rank"),
        (RankPolicy(8, None), 4, "lora_aggregation"),
        (RankPolicy(8, "ffa"), 4, "lora_aggregation"),
        (RankPolicy(8, "svd", lossless_downlink=False), 4, "downlink_codec"),
    ],
)
def test_a_coordinator_refuses_ranks_it_cannot_take_naming_the_key(policy, rank, key):
    with pytest.raises(AdapterRankError) as info:
        policy.check(rank)
    assert info.value.key == key and str(rank) in str(info.value)


def test_a_coordinator_takes_its_own_rank_none_and_lower_ones_under_svd():
    for rank in (0, 8):
        RankPolicy(8, None).check(rank)
    for rank in (1, 4, 8):
        RankPolicy(8, "svd").check(rank)
