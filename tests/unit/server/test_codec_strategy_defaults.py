"""A codec's strategy defaults (``Codec.auto_strategy``): ``sparseloco`` under DiLoCo takes
SparseLoCo's outer step (plain SGD at ``OUTER_LR``, mean over senders) where the config is silent."""

from __future__ import annotations

import pytest

from fedgrid.aggregation.sender_mean import SenderMean
from fedgrid.aggregation.server_opt import ServerSGD
from fedgrid.compression.sparseloco import OUTER_LR
from fedgrid.config import load_config
from fedgrid.server.strategies import build_strategy, codec_strategy_defaults


def _outer(overrides: dict) -> tuple[ServerSGD, object]:
    strategy = build_strategy(load_config(overrides=overrides))
    opt = strategy.server_optimizer  # type: ignore[attr-defined]
    assert isinstance(opt, ServerSGD)
    return opt, strategy.aggregator  # type: ignore[attr-defined]


@pytest.mark.parametrize("strategy", ["diloco", "streaming-diloco"])
@pytest.mark.parametrize("codec", ["sparseloco", "sparseloco:96", "sparseloco+zstd"])
def test_sparseloco_under_diloco_takes_sparselocos_outer_step(strategy: str, codec: str) -> None:
    opt, aggregator = _outer({"strategy": strategy, "codec": codec})
    assert (opt.lr, opt.momentum, opt.nesterov) == (OUTER_LR, 0.0, False) and OUTER_LR == 1.5
    assert isinstance(aggregator, SenderMean)


def test_what_the_config_sets_wins_and_other_codecs_and_strategies_keep_their_defaults() -> None:
    opt, aggregator = _outer({"strategy": "diloco", "codec": "sparseloco", "outer_lr": 0.5})
    assert (opt.lr, opt.momentum) == (0.5, 0.0) and isinstance(aggregator, SenderMean)
    opt, aggregator = _outer(
        {"strategy": "diloco", "codec": "sparseloco", "outer_momentum": 0.9, "aggregator": "mean"}
    )
    assert (opt.lr, opt.momentum, opt.nesterov) == (OUTER_LR, 0.9, True)
    assert not isinstance(aggregator, SenderMean)
    for codec in ("none", "fp4", "demo", "topk:0.01"):
        opt, aggregator = _outer({"strategy": "diloco", "codec": codec})
        assert (opt.lr, opt.momentum, opt.nesterov, aggregator) == (0.7, 0.9, True, None)
    assert codec_strategy_defaults(load_config(overrides={"strategy": "fedavg", "codec": "sparseloco"})) == {}


def test_the_codec_chosen_outer_step_is_logged_since_the_written_config_leaves_it_unset(caplog) -> None:
    with caplog.at_level("INFO", logger="fedgrid.server.strategies"):
        build_strategy(load_config(overrides={"strategy": "diloco", "codec": "sparseloco", "outer_lr": 0.5}))
    (line,) = [r.getMessage() for r in caplog.records if r.name == "fedgrid.server.strategies"]
    assert line == (
        "codec sparseloco sets diloco's outer_momentum = 0.0, aggregator = 'sender-mean' "
        "(set the keys to choose others)"
    )
    caplog.clear()
    with caplog.at_level("INFO", logger="fedgrid.server.strategies"):
        build_strategy(load_config(overrides={"strategy": "diloco", "codec": "fp4"}))
    assert [r for r in caplog.records if r.name == "fedgrid.server.strategies"] == []
