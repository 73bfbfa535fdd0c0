"""Codec and strategy meet through a capability each declares (``fedgrid.types.UpdateRole``):
a strategy what it makes of the updates (``Strategy.update_role``), a codec its form and its
strategy defaults per role (``Codec.form_under``, ``Codec.auto_strategy``). Neither names the
other: a strategy of any name that declares an outer optimizer gets the outer-gradient form."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedgrid.aggregation.by_name import STRATEGIES, strategy_role
from fedgrid.compression.sparseloco import OUTER_LR
from fedgrid.compression.spec import CodecSpec
from fedgrid.errors import ConfigError
from fedgrid.types import UpdateRole


def test_each_built_in_strategy_declares_its_role() -> None:
    roles = {name: strategy_role(name) for name in STRATEGIES}
    outer = {name for name, role in roles.items() if role is UpdateRole.OUTER_GRADIENT}
    assert outer == {"diloco", "streaming-diloco"}
    assert {roles[n] for n in set(STRATEGIES) - outer} == {UpdateRole.MODEL_AVERAGE}
    with pytest.raises(ConfigError, match="unknown strategy 'nope'"):
        strategy_role("nope")


def test_a_codec_states_its_form_and_defaults_per_role_not_per_strategy_name() -> None:
    sparseloco, demo, topk = (CodecSpec.parse(s) for s in ("sparseloco:96+zstd", "demo", "topk"))
    assert sparseloco.form_under(UpdateRole.OUTER_GRADIENT) is sparseloco
    assert sparseloco.form_under(UpdateRole.MODEL_AVERAGE).text == "sparseloco:96:scaled+zstd"
    assert demo.form_under(UpdateRole.MODEL_AVERAGE).text == "demo:320:scaled"
    assert topk.form_under(UpdateRole.MODEL_AVERAGE) is topk
    assert dict(sparseloco.decoder.auto_strategy[UpdateRole.OUTER_GRADIENT]) == {
        "outer_lr": OUTER_LR,
        "outer_momentum": 0.0,
        "aggregator": "sender-mean",
    }
    assert UpdateRole.MODEL_AVERAGE not in sparseloco.decoder.auto_strategy
    assert not demo.decoder.auto_strategy and not topk.decoder.auto_strategy


def test_no_compression_module_names_a_strategy() -> None:
    import fedgrid.compression

    folder = Path(fedgrid.compression.__file__).parent
    named = [
        (path.name, name)
        for path in sorted(folder.glob("*.py"))
        for name in STRATEGIES
        if f'"{name}"' in path.read_text() or f"'{name}'" in path.read_text()
    ]
    assert named == []
