"""Late results of semi-asynchronous rounds (``aggregation/staleness.py``): the FedBuff weight,
the rebase on the task's model, and the merge arithmetic on a tiny model, by hand."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.fedopt import FedAvgM
from fedgrid.aggregation.staleness import rebase, staleness_weight
from fedgrid.aggregation.updates import as_model
from fedgrid.types import ClientInfo, FitRes

pytestmark = pytest.mark.timeout(30)


def test_weight_is_fedbuffs_polynomial_discount():
    assert staleness_weight(8, 0, 0.5) == 8.0
    assert staleness_weight(8, 3, 0.5) == 4.0  # 8 * (1 + 3) ** -0.5
    assert staleness_weight(9, 2, 1.0) == 3.0
    assert staleness_weight(5, 7, 0.0) == 5.0  # a = 0: no discount
    with pytest.raises(ValueError, match="staleness must be at least 0, got -1"):
        staleness_weight(1, -1, 0.5)
    with pytest.raises(ValueError, match="exponent must be at least 0"):
        staleness_weight(1, 1, -0.5)


def test_rebase_takes_the_difference_from_the_tasks_model():
    base = OrderedDict(w=torch.tensor([1.0, 2.0]), n=torch.tensor(3))
    res = FitRes(ClientInfo("c", name="c"), OrderedDict(w=torch.tensor([1.5, 4.0]), n=torch.tensor(5)), 2)
    late = rebase(res, base, weight=0.75)
    assert late.delta and late.weight == 0.75 and late.mean_weight == 0.75 and late.num_examples == 2
    assert torch.equal(late.state["w"], torch.tensor([0.5, 2.0]))
    assert torch.equal(late.state["n"], torch.tensor(5))  # integer buffers stay values
    already = FitRes(res.client, OrderedDict(w=torch.tensor([0.5, 2.0])), 2, delta=True)
    assert rebase(already, base, weight=1.0).state["w"] is already.state["w"]  # as sent
    with pytest.raises(ValueError, match="tensor 'w' does not match its task's model"):
        rebase(res, OrderedDict(w=torch.zeros(3)), weight=1.0)


def _merge(strategy, current, task_model):
    """One fresh result (current + 1, 1 example) and one late result trained from
    ``task_model`` (task_model + 10, 4 examples, 2 rounds stale) merged as the engine does."""
    strategy.initialize(initial_state=current)
    fresh = FitRes(ClientInfo("a", name="a"), OrderedDict(w=current["w"] + 1), 1)
    weight = staleness_weight(4, 2, 0.5)
    late = rebase(
        FitRes(ClientInfo("b", name="b"), OrderedDict(w=task_model["w"] + 10), 4), task_model, weight=weight
    )
    results = [fresh, late]
    if not strategy.accepts_deltas:
        results = [as_model(current, r) for r in results]
    strategy.aggregate(server_round=3, results=results, failures=[])
    return strategy.global_state["w"], weight


@pytest.mark.parametrize(
    "strategy", [FedAvg(), FedAvgM(server_lr=1.0, server_momentum=0.0)], ids=["fedavg", "fedavgm"]
)
def test_merge_adds_the_weighted_mean_of_differences_to_the_current_model(strategy):
    current = OrderedDict(w=torch.tensor([5.0, -2.0, 0.25]))
    task_model = OrderedDict(w=torch.tensor([3.0, 7.0, 1.0]))  # what the late result trained from
    merged, weight = _merge(strategy, current, task_model)
    assert weight == 4 * 3**-0.5
    # current + (1 * 1 + w * 10) / (1 + w): the late result moves the model by its own
    # difference (+10), not towards its absolute values (task_model + 10).
    expected = (current["w"].double() + (1.0 + weight * 10.0) / (1.0 + weight)).float()
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-6)


def test_fresh_results_merge_as_today():
    """Staleness 0 through the late path gives today's FedAvg (weights are num_examples)."""
    current = OrderedDict(w=torch.tensor([1.0, 2.0]))
    values = [torch.tensor([2.0, 3.0]), torch.tensor([4.0, -1.0])]
    today, late_path = FedAvg(), FedAvg()
    today.initialize(initial_state=current)
    late_path.initialize(initial_state=current)
    results = [
        FitRes(ClientInfo(f"c{i}", name=f"c{i}"), OrderedDict(w=v), 1 + i) for i, v in enumerate(values)
    ]
    today.aggregate(server_round=1, results=results, failures=[])
    rebased = [
        as_model(current, rebase(r, current, weight=staleness_weight(r.num_examples, 0, 0.5)))
        for r in results
    ]
    late_path.aggregate(server_round=1, results=rebased, failures=[])
    assert torch.equal(today.global_state["w"], late_path.global_state["w"])
