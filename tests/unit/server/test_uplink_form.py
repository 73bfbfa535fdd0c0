"""The form a codec is sent as (``Codec.form_under``, ``codec_policy.uplink_form``): under the
strategies that average client models, ``sparseloco`` and ``demo`` go as their ``:scaled`` forms
(without error feedback), since their plain forms' residuals wait rounds under partial
participation (digits, 5 rounds: tests/integration/test_codec_defaults_learn.py); under DiLoCo,
with a named error feedback, under SecAgg+ or a custom strategy, a spec goes as written."""

from __future__ import annotations

from typing import Any

import pytest

from fedgrid.compression import parse_codec_spec
from fedgrid.compression.feedback import FeedbackRule
from fedgrid.config import load_config
from fedgrid.fleet.codec_policy import build_codec_policy, uplink_form


def _form(codec: str, **overrides: Any) -> str:
    config = load_config(overrides={"codec": codec, **overrides})
    return uplink_form(config.codecs.uplink, config).text


@pytest.mark.parametrize("strategy", ["fedavg", "fedavgm", "fedadam", "fedprox", "scaffold", "bcd"])
def test_under_model_averaging_the_chunked_codecs_go_scaled(strategy: str) -> None:
    assert _form("sparseloco", strategy=strategy) == "sparseloco:64:scaled"
    assert _form("sparseloco:96+zstd", strategy=strategy) == "sparseloco:96:scaled+zstd"
    assert _form("demo:32", strategy=strategy) == "demo:32:scaled"
    # A bare demo keeps FEDAVG_K there (an MLP has no smooth rows for the DCT); a named K stays.
    assert _form("demo", strategy=strategy) == "demo:320:scaled"
    assert _form("demo:64", strategy=strategy) == "demo:64:scaled"
    assert _form("sparseloco:64", strategy=strategy) == "sparseloco:64:scaled"
    for spec in ("none", "int8", "topk", "topk:0.05:scaled", "randk", "sign", "fp4", "sparseloco:64:scaled"):
        assert _form(spec, strategy=strategy) == spec
    # The scaled form runs without a residual under auto, where the plain one kept momentum:0.95.
    assert FeedbackRule.parse("auto").for_codec(parse_codec_spec("sparseloco:64:scaled")).kind == "none"
    assert FeedbackRule.parse("auto").for_codec(parse_codec_spec("sparseloco")).beta == 0.95


def test_diloco_a_named_rule_secagg_and_custom_strategies_keep_the_spec() -> None:
    for strategy in ("diloco", "streaming-diloco"):
        assert _form("sparseloco", strategy=strategy) == "sparseloco"
        assert _form("demo", strategy=strategy) == "demo"
    assert _form("sparseloco", error_feedback="momentum:0.95") == "sparseloco"
    assert _form("sparseloco", error_feedback="classic") == "sparseloco"
    assert _form("sparseloco", strategy="tests.support.strategies:Custom") == "sparseloco"


def test_the_policy_sends_each_region_its_form_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    config = load_config(overrides={"codec": "sparseloco", "region_codecs": "eu=demo:8,us=int8"})
    with caplog.at_level("INFO", logger="fedgrid.fleet.codec_policy"):
        policy = build_codec_policy(config)
    assert policy.default.text == "sparseloco:64:scaled"
    assert {region: spec.text for region, spec in policy.by_region.items()} == {
        "eu": "demo:8:scaled",
        "us": "int8",
    }
    assert [r.getMessage() for r in caplog.records] == [
        "codec sparseloco is sent as sparseloco:64:scaled under fedavg, the form of it that learns there "
        "(name it to choose)",
        "codec demo:8 is sent as demo:8:scaled under fedavg, the form of it that learns there "
        "(name it to choose)",
    ]
    assert build_codec_policy(
        load_config(overrides={"codec": "sparseloco", "strategy": "diloco"})
    ).default.text == ("sparseloco")
