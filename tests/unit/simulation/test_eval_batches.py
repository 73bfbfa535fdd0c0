"""``eval_batches`` bounds the server-side evaluation (issue 40, item 2): at most that many
batches of the test split, a fixed random subset of it, the same in every run."""

from __future__ import annotations

import pytest
import torch

from fedgrid.simulation.evaluation import EVAL_CHUNK, bounded_index, make_evaluate
from fedgrid.simulation.tasks import resolve


def test_a_bounded_evaluation_reads_a_fixed_sorted_subset():
    chosen = bounded_index(None, 10_000, 3 * EVAL_CHUNK)
    assert chosen is not None and len(chosen) == 3 * EVAL_CHUNK
    assert torch.equal(chosen, torch.sort(chosen).values) and len(set(chosen.tolist())) == len(chosen)
    assert torch.equal(chosen, bounded_index(None, 10_000, 3 * EVAL_CHUNK))  # every run, every round
    # Of a subset already chosen (a dataset's eval_limit): elements of it.
    within = torch.arange(0, 20_000, 2)
    picked = bounded_index(within, len(within) * 2, 100)
    assert picked is not None and len(picked) == 100 and bool((picked % 2 == 0).all())
    assert bounded_index(within, 20_000, 50_000) is within  # no more than there is: all of it


def test_fewer_batches_read_fewer_examples_and_change_the_figures():
    state = resolve(dataset="synthetic", seed=1).initial_state
    full_loss, full = make_evaluate("synthetic", eval_batches=8)(state)
    one_loss, one = make_evaluate("synthetic", eval_batches=1)(state)
    assert make_evaluate("synthetic", eval_batches=1)(state) == (one_loss, one)  # deterministic
    assert (one_loss, one) != (full_loss, full)


@pytest.mark.parametrize("value", [0, -1])
def test_eval_batches_below_one_is_refused(value):
    with pytest.raises(ValueError, match="eval_batches must be at least 1"):
        make_evaluate("synthetic", eval_batches=value)
