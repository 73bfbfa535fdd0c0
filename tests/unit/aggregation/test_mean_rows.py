"""``weighted_mean_of_rows``: the batched engine's stacked outputs averaged one reduction per stack,
equal to the per-update ``weighted_mean`` within float64 rounding; anything that is not a row falls back."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.mean import weighted_mean, weighted_mean_of_rows
from fedgrid.types import ClientInfo, FitRes


def _per_update(tensors, weights):
    return weighted_mean([{"t": t} for t in tensors], weights)["t"]


def test_rows_of_one_stack_equal_the_per_update_mean():
    g = torch.Generator().manual_seed(0)
    stack = torch.randn(7, 5, 300, generator=g)
    weights = [3.0, 100.0, 1.0, 17.0, 5.0, 2.0, 640.0]
    rows = [stack[i] for i in range(7)]
    got = weighted_mean_of_rows(
        rows, weights, slice_elements=64
    )  # slices of 9 elements per row: many slices, one short
    want = _per_update(rows, weights)
    assert got is not None and got.dtype == torch.float32 and got.shape == (5, 300)
    torch.testing.assert_close(got, want, atol=0, rtol=2**-23)  # at most about one float32 ulp apart
    assert (
        got != want
    ).float().mean() < 0.01  # float64 sums: after the cast, nearly every element is the same bits


def test_two_stacks_a_subset_of_rows_any_order_and_integers():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, 10, generator=g), torch.randn(3, 10, generator=g)
    rows = [b[2], a[0], a[3], b[0]]  # not every row of a stack, and not in stack order
    weights = [1.0, 2.0, 3.0, 4.0]
    got = weighted_mean_of_rows(rows, weights)
    torch.testing.assert_close(got, _per_update(rows, weights), atol=1e-7, rtol=0)
    counts = torch.tensor([[3, 8], [5, 1], [4, 4]])
    got_int = weighted_mean_of_rows([counts[0], counts[1], counts[2]], [1.0, 1.0, 2.0])
    assert got_int.dtype == torch.int64 and torch.equal(
        got_int, _per_update([counts[0], counts[1], counts[2]], [1.0, 1.0, 2.0])
    )


def test_what_is_not_a_row_of_a_stack_falls_back():
    stack = torch.randn(3, 4, 4)
    assert weighted_mean_of_rows([stack[0], stack[1].clone()], [1.0, 1.0]) is None  # a copy
    assert weighted_mean_of_rows([stack[0, 1:], stack[1, 1:]], [1.0, 1.0]) is None  # part of a row
    assert (
        weighted_mean_of_rows([stack[:, 0][0], stack[:, 0][1]], [1.0, 1.0]) is None
    )  # rows of a non-contiguous view
    assert weighted_mean_of_rows([torch.randn(2, 3, dtype=torch.complex64)[0]] * 2, [1.0, 1.0]) is None
    assert weighted_mean_of_rows([], []) is None
    with pytest.raises(ValueError, match="positive and finite"):
        weighted_mean_of_rows([stack[0], stack[1]], [1.0, float("inf")])


def _results(states):
    return [
        FitRes(ClientInfo(client_id=f"c{i}", name=f"c{i}", num_examples=n), state, n, {"loss": 1.0})
        for i, (state, n) in enumerate(states)
    ]


def test_fedavg_averages_stacked_results_in_one_reduction(monkeypatch):
    g = torch.Generator().manual_seed(2)
    initial = OrderedDict(w=torch.zeros(6, 4), b=torch.zeros(4))
    stacks = {n: torch.randn(5, *t.shape, generator=g) for n, t in initial.items()}
    sizes = [10, 30, 5, 7, 48]
    stacked = _results([(OrderedDict((n, s[i]) for n, s in stacks.items()), sizes[i]) for i in range(5)])
    copied = _results(
        [(OrderedDict((n, s[i].clone()) for n, s in stacks.items()), sizes[i]) for i in range(5)]
    )
    calls = []
    import fedgrid.aggregation.fedavg as fedavg_mod

    real = fedavg_mod.weighted_mean_of_rows
    monkeypatch.setattr(
        fedavg_mod, "weighted_mean_of_rows", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1]
    )
    fast, slow = FedAvg(), FedAvg()
    for strategy, results in ((fast, stacked), (slow, copied)):
        strategy.initialize(initial_state=initial)
        strategy.aggregate(server_round=1, results=results, failures=[])
    assert len(calls) == 4 and [c is not None for c in calls] == [
        True,
        True,
        False,
        False,
    ]  # 2 tensors each run
    for name in initial:
        torch.testing.assert_close(fast.global_state[name], slow.global_state[name], atol=1e-7, rtol=0)
        assert not torch.equal(fast.global_state[name], initial[name])
