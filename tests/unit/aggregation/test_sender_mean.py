"""``sender-mean``: per entry, the weighted mean over the updates that sent it (Templar's sparse mean)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from fedgrid.aggregation.by_name import build_aggregator
from fedgrid.aggregation.mean import weighted_mean
from fedgrid.aggregation.sender_mean import SenderMean
from fedgrid.errors import ConfigError


def _mean(updates: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    agg = build_aggregator("sender-mean")
    for update, weight in zip(updates, weights):
        agg.add(OrderedDict(update), weight)
    return agg.result()


def test_each_entry_is_the_weighted_mean_of_its_senders() -> None:
    a = torch.tensor([1.0, 0.0, 3.0, 0.0])
    b = torch.tensor([3.0, 2.0, 0.0, 0.0])
    out = _mean([{"w": a}, {"w": b}], [1.0, 3.0])
    # entry 0: both sent, (1 * 1 + 3 * 3) / 4; entry 1: b alone; entry 2: a alone; entry 3: nobody
    torch.testing.assert_close(out["w"], torch.tensor([2.5, 2.0, 3.0, 0.0]), rtol=0, atol=0)


def test_dense_updates_give_the_weighted_mean_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(3)
    updates = [{"w": torch.randn(50, generator=gen), "b": torch.randn(5, generator=gen)} for _ in range(4)]
    weights = [1.0, 2.0, 5.0, 0.5]
    got, want = _mean(updates, weights), weighted_mean(updates, weights)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=0)


def test_integer_tensors_take_the_weighted_mean_and_the_accumulators_reset() -> None:
    agg = SenderMean()
    agg.add({"steps": torch.tensor(2), "w": torch.tensor([0.0, 1.0])}, 1.0)
    agg.add({"steps": torch.tensor(6), "w": torch.tensor([0.0, 3.0])}, 1.0)
    out = agg.result()
    assert int(out["steps"]) == 4 and out["steps"].dtype == torch.int64
    torch.testing.assert_close(out["w"], torch.tensor([0.0, 2.0]))
    with pytest.raises(ValueError, match="no update was added"):
        agg.result()
    with pytest.raises(ValueError, match="positive and finite"):
        agg.add({"w": torch.zeros(2)}, 0.0)


def test_it_takes_no_option() -> None:
    with pytest.raises(ConfigError, match="sender-mean takes no option 'weighted'") as err:
        build_aggregator("sender-mean", weighted=False)
    assert err.value.key == "aggregator"


def test_secagg_refuses_it_naming_the_key() -> None:
    from fedgrid.config import load_config

    # SecAgg+ gives the coordinator only the sum, not which client sent which entry.
    with pytest.raises(ConfigError, match="only a sum") as err:
        load_config(overrides={"codec": "int8", "aggregator": "sender-mean", "secagg": True})
    assert err.value.key == "aggregator"
