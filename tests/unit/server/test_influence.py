"""The caps on one round's results (``server/influence.py``): claims counted at most at k times the
round's median claim or at a quota, updates farther than k times the median distance refused."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch

from fedgrid.config import load_config
from fedgrid.errors import ConfigError
from fedgrid.events import EventLog
from fedgrid.fleet.base import LateResult, RoundOutcome
from fedgrid.server.influence import (
    CLAIMS_CAPPED,
    UPDATES_REFUSED,
    Influence,
    build_influence,
    load_quotas,
    share_caps,
    update_distance,
)
from fedgrid.types import ClientInfo, Failure, FitRes

BASE = OrderedDict(w=torch.zeros(2, 3), b=torch.zeros(4), steps=torch.tensor(7))


def _res(name: str, claim: int, by: float = 0.1, *, delta: bool = False, names=("w", "b", "steps")) -> FitRes:
    state = OrderedDict(
        (
            n,
            BASE[n] + by
            if BASE[n].is_floating_point() and not delta
            else (torch.full_like(BASE[n], by) if BASE[n].is_floating_point() else BASE[n]),
        )
        for n in names
    )
    return FitRes(ClientInfo(f"id-{name}", name=name, num_examples=claim), state, claim, delta=delta)


def _bound(influence: Influence, results, late=(), failures=()):
    seen: list = []
    events = EventLog()
    events.subscribe(seen.append)
    outcome = RoundOutcome(list(results), list(failures), late=list(late), extra={"uplink_ratio": 2.0})
    return influence.bound(3, outcome, BASE, events=events), seen


def test_a_claim_counts_for_at_most_k_times_the_rounds_lower_median_claim():
    # The ratio cap alone (the share cap, below, is off).
    for liar in (10**9, 10**8, 7001):
        out, seen = _bound(
            Influence(max_weight_share=0), [_res("a", 700), _res("b", 650), _res("liar", liar)]
        )
        assert [r.num_examples for r in out.results] == [700, 650, 7000]  # median_low(650, 700, liar) = 700
        assert out.extra == {"uplink_ratio": 2.0, CLAIMS_CAPPED: 1.0} and out.failures == []
        assert [(e.event, e["name"], e["claimed"], e["cap"]) for e in seen] == [
            ("claim_capped", "liar", liar, 7000)
        ]
    # Two clients: the lower median is the honest one's claim, whoever lies.
    out, _ = _bound(Influence(max_weight_ratio=2.5, max_weight_share=0), [_res("liar", 10**9), _res("a", 3)])
    assert [r.num_examples for r in out.results] == [7, 3]
    # Honest differences within the ratio are kept as claimed.
    out, seen = _bound(Influence(max_weight_share=0), [_res("a", 100), _res("b", 999), _res("c", 30)])
    assert (
        [r.num_examples for r in out.results] == [100, 999, 30]
        and seen == []
        and CLAIMS_CAPPED not in out.extra
    )


def test_quotas_cap_their_identities_and_the_ratio_the_others():
    quotas = {"big": 5000, "small": 10}
    out, seen = _bound(
        Influence(client_quotas=quotas, max_weight_share=0),
        [_res("big", 10**9), _res("small", 20), _res("free", 10**6)],
    )
    # Median over the claims as their quotas count them: (5000, 10, 10**6) -> 5000; ratio cap 50000.
    assert [r.num_examples for r in out.results] == [5000, 10, 50000]
    assert out.extra[CLAIMS_CAPPED] == 3.0 and [e["cap"] for e in seen] == [5000, 10, 50000]
    out, _ = _bound(
        Influence(max_weight_ratio=0, client_quotas=quotas, max_weight_share=0),
        [_res("big", 10**9), _res("free", 10**6)],
    )
    assert [r.num_examples for r in out.results] == [5000, 10**6]  # quotas only
    out, _ = _bound(
        Influence(max_weight_ratio=0, max_update_ratio=0, max_weight_share=0),
        [_res("a", 1), _res("b", 10**9)],
    )
    assert [r.num_examples for r in out.results] == [1, 10**9]  # everything off: as claimed


def test_an_update_far_from_the_median_distance_is_refused_naming_the_numbers():
    results = [_res("a", 3, 0.1), _res("b", 3, 0.2), _res("scaled", 3, 100.0), _res("huge", 3, 3e38)]
    out, seen = _bound(Influence(), results, failures=[Failure(ClientInfo("id-x", name="x"), "timed out")])
    assert [r.client.name for r in out.results] == ["a", "b"]
    assert [f.client.name for f in out.failures] == ["x", "scaled", "huge"]
    # 10 floating values each: the distance of b (0.2 * sqrt(10)) is the lower median of four.
    assert out.failures[1].reason == (
        "update refused: its distance 316.228 from its task's model is over max_update_ratio 10 x the "
        "round's median distance 0.632456 (4 fresh updates)"
    )
    assert "its distance 9.48683e+38" in out.failures[2].reason
    assert out.extra[UPDATES_REFUSED] == 2.0
    refused = [e for e in seen if e.event == "update_refused"]
    assert [(e["name"], e["median"], e["ratio"]) for e in refused] == [
        ("scaled", pytest.approx(0.2 * math.sqrt(10)), 10.0),
        ("huge", pytest.approx(0.2 * math.sqrt(10)), 10.0),
    ]
    # Within k of the median: kept (the median update's distance check, 17x here, off). Off: everything kept.
    out, _ = _bound(
        Influence(max_deviation_ratio=0), [_res("a", 3, 0.1), _res("b", 3, 0.2), _res("c", 3, 1.9)]
    )
    assert len(out.results) == 3
    out, _ = _bound(Influence(max_update_ratio=0, max_deviation_ratio=0), results)
    assert len(out.results) == 4


def test_distances_of_deltas_and_values_agree_and_ignore_integer_tensors():
    assert update_distance(_res("v", 3, 0.5), BASE) == pytest.approx(0.5 * math.sqrt(10), abs=1e-12)
    assert update_distance(_res("d", 3, 0.5, delta=True), BASE) == update_distance(_res("v", 3, 0.5), BASE)
    steps = _res("s", 3, 0.5)
    steps.state["steps"] = torch.tensor(10**9)
    assert update_distance(steps, BASE) == update_distance(_res("v", 3, 0.5), BASE)


def test_updates_of_different_tensors_are_compared_among_themselves():
    # Block-coordinate clients: two train w (6 values), two train b (4 values) with larger steps.
    results = [
        _res("w1", 3, 0.1, names=("w",)),
        _res("w2", 3, 0.1, names=("w",)),
        _res("b1", 3, 5.0, names=("b",)),
        _res("b2", 3, 6.0, names=("b",)),
    ]
    out, _ = _bound(Influence(), results)
    assert len(out.results) == 4  # compared across blocks, b1 and b2 would be 50x w's median
    out, _ = _bound(Influence(), [*results, _res("w3", 3, 100.0, names=("w",))])
    assert [f.client.name for f in out.failures] == ["w3"]


def test_late_results_are_measured_from_their_own_task_and_capped_in_the_same_round():
    older = OrderedDict((n, t + 1.0 if t.is_floating_point() else t) for n, t in BASE.items())
    late_ok = FitRes(
        ClientInfo("id-l", name="late"),
        OrderedDict((n, t + 0.15 if t.is_floating_point() else t) for n, t in older.items()),
        10**9,
    )
    late_far = FitRes(
        ClientInfo("id-f", name="far"),
        OrderedDict((n, t + 50.0 if t.is_floating_point() else t) for n, t in older.items()),
        3,
    )
    out, _ = _bound(
        Influence(max_weight_share=0),
        [_res("a", 3, 0.1), _res("b", 3, 0.2)],
        late=[LateResult(late_ok, 2, older), LateResult(late_far, 1, older)],
    )
    assert [item.result.client.name for item in out.late] == ["late"]  # 0.15 from its own task's model
    assert out.late[0].result.num_examples == 30 and out.late[0].task_round == 2
    assert [f.client.name for f in out.failures] == ["far"]


def test_bad_settings_are_refused_naming_the_key(tmp_path):
    for key in ("max_weight_ratio", "max_update_ratio"):
        for bad in (0.5, math.inf, -1.0):
            with pytest.raises(ValueError, match=key):
                Influence(**{key: bad})
            with pytest.raises(ConfigError, match=key):
                load_config(overrides={key: bad})
    with pytest.raises(ValueError, match="client quota of 'x' must be an integer at least 1, got 0"):
        Influence(client_quotas={"x": 0})
    quotas = tmp_path / "quotas.toml"
    quotas.write_text('"site-a" = 12000\n"hospital b" = 800\n')
    assert load_quotas(quotas) == {"site-a": 12000, "hospital b": 800}
    config = load_config(overrides={"client_quotas": str(quotas), "max_weight_ratio": 4.0})
    assert build_influence(config) == Influence(
        max_weight_ratio=4.0, client_quotas={"site-a": 12000, "hospital b": 800}
    )
    assert build_influence(load_config()) == Influence()  # on by default: k = 10 for both
    quotas.write_text('"site-a" = 1.5\n')
    with pytest.raises(ConfigError, match="the quota of 'site-a' must be an integer at least 1"):
        load_quotas(quotas)
    quotas.write_text("site-a = \n")
    with pytest.raises(ConfigError, match="is not TOML"):
        load_quotas(quotas)
    with pytest.raises(ConfigError, match="client_quotas.*cannot read"):
        load_quotas(tmp_path / "missing.toml")


def _late(name: str, by: float, task_round: int) -> LateResult:
    """A late result ``by`` from its task's model on every floating value (10 of them)."""
    return LateResult(_res(name, 3, by), task_round, BASE)


def test_a_late_result_is_measured_against_its_own_task_rounds_fresh_updates():
    """Early rounds step far, later ones little: a late result of round 1 stepping 12x as far as
    round 3's fresh update is 1.2x round 1's fresh median, kept; at 20x round 1's it is refused,
    naming that round. The references come back from ``state_dict`` as a checkpoint keeps them."""
    influence = Influence()
    influence.bound(1, RoundOutcome([_res("a", 3, 1.0), _res("b", 3, 1.2)], []), BASE)  # median 1.0
    out, seen = _bound(influence, [_res("a", 3, 0.1)], late=[_late("slow", 1.2, 1), _late("evil", 20.0, 1)])
    assert [item.result.client.name for item in out.late] == ["slow"]
    assert [f.client.name for f in out.failures] == ["evil"]
    assert out.failures[0].reason == (
        "update refused: its distance 63.2456 from its task's model is over max_update_ratio 10 x the "
        "median distance 3.16228 of round 1's fresh updates"
    )
    assert [(e["name"], round(e["median"], 4)) for e in seen if e.event == "update_refused"] == [
        ("evil", 3.1623)
    ]
    # Without round 1's reference (a coordinator that never saw it): the merging round's median.
    out, _ = _bound(Influence(), [_res("a", 3, 0.1)], late=[_late("slow", 1.2, 1)])
    assert [f.client.name for f in out.failures] == ["slow"]
    restored = Influence()
    restored.load_state_dict(influence.state_dict())
    assert restored.references == influence.references and set(restored.references) == {1, 3}
    out, _ = _bound(restored, [_res("a", 3, 0.1)], late=[_late("slow", 1.2, 1)])
    assert out.failures == [] and [item.result.client.name for item in out.late] == ["slow"]


def test_references_are_kept_for_a_bounded_number_of_rounds():
    influence = Influence()
    for r in range(1, 300):
        influence.bound(r, RoundOutcome([_res("a", 3, 0.1)], []), BASE)
    assert min(influence.references) == 299 - 256 + 1 and len(influence.references) == 256


def test_late_results_never_set_the_reference_of_the_round_they_merge_into():
    """The issue's quorum run (``--min-quorum 2 --grace-s 1 --max-staleness 2``): round 2's two
    fresh honest updates step 3.65 from round 2's model; two late results of round 1's tasks, from
    other identities, step 0.0696 from theirs. The late ones once set round 2's lower median
    (0.0696) and both fresh updates were refused; now the fresh ones set it, and the late ones are
    measured against round 1's."""
    per_value = 1 / math.sqrt(10)  # a _res step ``by`` is a distance of by * sqrt(10)
    influence = Influence()
    influence.bound(
        1, RoundOutcome([_res("a", 3, 0.05 * per_value), _res("b", 3, 0.06 * per_value)], []), BASE
    )
    fresh = [_res("a", 3, 3.65 * per_value), _res("b", 3, 3.66 * per_value)]
    late = [_late("c", 0.0696 * per_value, 1), _late("d", 0.0697 * per_value, 1)]
    out, seen = _bound(influence, fresh, late=late)
    assert out.failures == [] and [e.event for e in seen] == []
    assert [r.client.name for r in out.results] == ["a", "b"]
    assert [item.result.client.name for item in out.late] == ["c", "d"]
    [(part, median)] = influence.references[3].items()
    assert median == pytest.approx(3.65)  # the fresh updates' lower median, not a late one's
    # A late result far from its own round's reference is still refused, naming that round.
    out, _ = _bound(influence, fresh, late=[_late("far", 5.0 * per_value, 1)])
    assert [f.client.name for f in out.failures] == ["far"] and "round 1's fresh updates" in out.failures[
        0
    ].reason


def test_a_round_with_one_fresh_update_falls_back_to_the_last_kept_reference():
    influence = Influence()
    influence.bound(1, RoundOutcome([_res("a", 3, 0.1), _res("b", 3, 0.12)], []), BASE)  # reference 0.1
    # One fresh update (an attacker's, 50x the usual step) and honest late ones: the lone update is
    # measured against round 1's reference, not against itself, and refused.
    out, _ = _bound(influence, [_res("evil", 3, 5.0)], late=[_late("c", 0.1, 1), _late("d", 0.11, 1)])
    assert [f.client.name for f in out.failures] == ["evil"]
    assert [item.result.client.name for item in out.late] == ["c", "d"]
    assert influence.references[3] == influence.references[1]  # the fallback is the round's reference
    # Only late results: nothing fresh sets round 4's reference; each is measured against its own.
    out, _ = _bound(Influence(), [], late=[_late("c", 0.1, 1)])
    assert out.failures == [] and len(out.late) == 1


def test_no_identity_holds_more_than_its_share_of_a_rounds_weight():
    # Three clients, a liar capped at 10x the median claim (6000) would hold 6000/7100 = 84%.
    assert share_caps([600, 500, 6000], ["a", "b", "liar"], 0.5) == [600, 500, 1100]  # 1100/2200
    # A share under an equal one is an equal one; 0 and 1 cap nothing.
    assert share_caps([600, 500, 6000], ["a", "b", "liar"], 0.25) == [500, 500, 500]
    assert share_caps([600, 500, 6000], ["a", "b", "liar"], 0) == [600, 500, 6000]
    assert share_caps([600, 500, 6000], ["a", "b", "liar"], 1.0) == [600, 500, 6000]
    # One identity's results (a fresh and a late one) share its cap in proportion.
    assert share_caps([300, 900, 200, 200], ["x", "x", "a", "b"], 0.5) == [100, 300, 200, 200]
    # Of two identities, the ratio cap alone (the share cap would make every round unweighted).
    assert share_caps([600, 6000], ["a", "liar"], 0.5) == [600, 6000]
    out, seen = _bound(Influence(), [_res("a", 600), _res("b", 500), _res("liar", 10**9)])
    assert [r.num_examples for r in out.results] == [600, 500, 1100]
    assert [(e["name"], e["cap"]) for e in seen] == [("liar", 1100)]
    out, _ = _bound(Influence(max_weight_share=0), [_res("a", 600), _res("b", 500), _res("liar", 10**9)])
    assert [r.num_examples for r in out.results] == [600, 500, 6000]
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="max_weight_share"):
            Influence(max_weight_share=bad)
        with pytest.raises(ConfigError, match="max_weight_share"):
            load_config(overrides={"max_weight_share": bad})
