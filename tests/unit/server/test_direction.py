"""The median update's checks (``server/direction.py``, ``Influence``'s direction and spread):
cosines and distances against the coordinate-wise lower median of a round's fresh updates."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch

from fedgrid.events import EventLog
from fedgrid.fleet.base import RoundOutcome
from fedgrid.server import direction
from fedgrid.server.direction import median_geometry
from fedgrid.server.influence import UPDATES_REFUSED, Influence
from fedgrid.types import ClientInfo, FitRes

BASE = OrderedDict(w=torch.zeros(4), steps=torch.tensor(7))


def _res(name: str, w: list[float]) -> FitRes:
    state = OrderedDict(w=torch.tensor(w), steps=torch.tensor(9))
    return FitRes(ClientInfo(f"id-{name}", name=name, num_examples=3), state, 3)


def _update(w: list[float], base=BASE, delta: bool = False):
    return OrderedDict(w=torch.tensor(w)), base, delta


def test_cosines_and_distances_against_the_coordinate_wise_lower_median():
    fresh = [
        _update([1.0, 0, 0, 0]),
        _update([0, 1.0, 0, 0]),
        _update([1.0, 1.0, 0, 0]),
        _update([-5.0, 0, 0, 9]),
    ]
    # Per coordinate, the lower median of four: (0, 0, 0, 0)... of (1, 0, 1, -5) -> 0; of (0, 1, 1, 0) -> 0.
    assert median_geometry(["w"], fresh) is None  # a median of zeros: no direction
    fresh = fresh[:3]  # medians (1, 1, 0, 0)
    late = [
        (OrderedDict(w=torch.tensor([3.0, 3.0, 0, 0])), OrderedDict(w=torch.tensor([2.0, 2.0, 0, 0])), False)
    ]
    geometry = median_geometry(["w"], fresh, late)
    assert geometry is not None
    assert geometry.cosines == pytest.approx([1 / math.sqrt(2), 1 / math.sqrt(2), 1.0, 1.0])
    assert geometry.deviations == pytest.approx([1.0, 1.0, 0.0, 0.0])  # the late one: 3 - 2 from its own base
    # A delta is taken as it is; a zero update has no direction (nan), and its distance is the median's norm.
    geometry = median_geometry(["w"], fresh, [(OrderedDict(w=torch.zeros(4)), BASE, True)])
    assert geometry is not None and math.isnan(geometry.cosines[3])
    assert geometry.deviations[3] == pytest.approx(math.sqrt(2))


def _bound(influence: Influence, results):
    seen: list = []
    events = EventLog()
    events.subscribe(seen.append)
    return influence.bound(2, RoundOutcome(list(results), []), BASE, events=events), seen


def test_an_update_pointing_away_or_lying_apart_is_refused_naming_the_numbers():
    honest = [_res("a", [1.0, 1.0, 0.2, 0]), _res("b", [1.0, 0.8, 0, 0.2]), _res("c", [0.8, 1.0, 0.1, 0.1])]
    # Pointing away (within the distance rule's 10x): cosine -1.
    out, seen = _bound(Influence(), [*honest, _res("away", [-1.0, -1.0, 0, 0])])
    assert [r.client.name for r in out.results] == ["a", "b", "c"]
    assert out.extra[UPDATES_REFUSED] == 1.0
    reason = out.failures[0].reason
    assert reason.startswith("update refused: it points away from the round's median update (cosine -1 ")
    assert "of 4 fresh updates, under min_update_cosine -0.5)" in reason
    assert [(e.event, e["name"]) for e in seen] == [("update_refused", "away")] and e_cos(seen) < -0.9
    # The same direction, 8x as far from the median update as the honest ones lie: apart.
    out, _ = _bound(Influence(), [*honest, _res("apart", [3.0, 3.0, 1.5, 1.5])])
    assert [f.client.name for f in out.failures] == ["apart"]
    assert (
        "is over max_deviation_ratio 3 x the fresh updates' median distance from it" in out.failures[0].reason
    )
    # Off, or fewer than 3 fresh updates: nothing measured.
    out, _ = _bound(
        Influence(min_update_cosine=-1, max_deviation_ratio=0), [*honest, _res("away", [-1.0, -1, 0, 0])]
    )
    assert len(out.results) == 4
    out, _ = _bound(Influence(), [honest[0], _res("away", [-1.0, -1.0, 0, 0])])
    assert len(out.results) == 2


def e_cos(seen) -> float:
    return seen[0]["cosine"]


def test_two_equal_updates_of_three_are_no_yardstick_for_the_spread():
    # The median is the two equal ones: their distance 0 is the lower median, which measures nothing.
    same = [_res("a", [1.0, 1.0, 0, 0]), _res("b", [1.0, 1.0, 0, 0]), _res("c", [1.2, 0.9, 0.1, 0])]
    out, _ = _bound(Influence(), same)
    assert len(out.results) == 3


def test_a_cosine_outside_minus_1_and_1_is_refused():
    for bad in (-1.5, 1.01, math.nan):
        with pytest.raises(ValueError, match="min_update_cosine must be a cosine in \\[-1, 1\\]"):
            Influence(min_update_cosine=bad)
    with pytest.raises(ValueError, match="max_deviation_ratio must be 0"):
        Influence(max_deviation_ratio=0.5)


def test_chunks_give_what_one_pass_gives(monkeypatch):
    g = torch.Generator().manual_seed(3)
    fresh = [(OrderedDict(w=torch.randn(5, 7, generator=g)), BASE, True) for _ in range(4)]
    late = [
        (OrderedDict(w=torch.randn(5, 7, generator=g)), OrderedDict(w=torch.randn(5, 7, generator=g)), False)
    ]
    whole = median_geometry(["w"], fresh, late)
    monkeypatch.setattr(direction, "CHUNK", 3)  # 35 values in 12 chunks
    chunked = median_geometry(["w"], fresh, late)
    assert whole is not None and chunked is not None
    assert chunked.cosines == pytest.approx(whole.cosines, abs=1e-12)
    assert chunked.deviations == pytest.approx(whole.deviations, abs=1e-12)
    stacked = torch.stack([u["w"] for u, _, _ in fresh]).median(dim=0).values.double().ravel()
    first = fresh[0][0]["w"].double().ravel()
    assert whole.cosines[0] == pytest.approx(
        float(first @ stacked / (first.norm() * stacked.norm())), abs=1e-12
    )


@pytest.mark.parametrize("count", [1, 2, 3, 4, 9, 10])
def test_the_lower_median_is_torchs(count):
    stack = torch.randn(count, 1000, generator=torch.Generator().manual_seed(count), dtype=torch.float64)
    assert torch.equal(direction._lower_median(stack), stack.median(dim=0).values)
    assert torch.equal(direction._lower_median(stack.float()), stack.float().median(dim=0).values)
