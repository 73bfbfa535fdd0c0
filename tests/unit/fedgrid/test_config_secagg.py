"""The secagg keys: flags of simulate and coordinator, TOML keys, and clear errors naming the key."""

from __future__ import annotations

import pytest

from fedgrid.aggregation.secagg import SecAgg
from fedgrid.cli import support
from fedgrid.compression.spec import CodecSpec
from fedgrid.config import load_config, parse_flags
from fedgrid.config_secagg import secagg_ring
from fedgrid.errors import ConfigError
from fedgrid.server.strategies import build_strategy

KEYS = ("secagg", "secagg_threshold", "secagg_neighbours", "secagg_clip")


def test_the_keys_are_flags_of_simulate_and_the_coordinator_and_toml_keys(tmp_path) -> None:
    for key in KEYS:
        assert key in support.SIMULATE_KEYS and key in support.COORDINATOR_KEYS
    path = tmp_path / "run.toml"
    path.write_text(
        "secagg = true\nsecagg_threshold = 4\nsecagg_neighbours = 6\nsecagg_clip = 0.25\ncodec = 'int8'\n"
    )
    config = load_config(path, parse_flags({"secagg_clip": "0.5"}))
    assert (config.secagg, config.secagg_threshold, config.secagg_neighbours, config.secagg_clip) == (
        True,
        4,
        6,
        0.5,
    )
    strategy = build_strategy(config)
    assert isinstance(strategy, SecAgg)
    assert (strategy.bits, strategy.clip, strategy.k, strategy.t) == (8, 0.5, 6, 4)
    assert build_strategy(load_config(overrides={"secagg": True})).bits == 32  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("overrides", "key", "text"),
    [
        ({"secagg_threshold": -1}, "secagg_threshold", "at least 0"),
        ({"secagg_neighbours": 5}, "secagg_neighbours", "even number at least 4"),
        ({"secagg_neighbours": 2}, "secagg_neighbours", "even number at least 4"),
        ({"secagg_clip": 0.0}, "secagg_clip", "positive finite"),
        ({"secagg_clip": float("inf")}, "secagg_clip", "positive finite"),
        ({"secagg_neighbours": 4, "secagg_threshold": 5}, "secagg_threshold", "more than the 4 neighbours"),
        ({"secagg_neighbours": 8, "secagg_threshold": 4}, "secagg_threshold", "not a majority of the 8"),
        ({"secagg": True, "codec": "topk:0.01"}, "codec", "must be one of none, fp16, bf16, int8"),
        ({"secagg": True, "codec": "topk:0.01"}, "codec", "or qsgd:LEVELS with 8 to 32767 levels"),
        ({"secagg": True, "codec": "qsgd:127+zstd"}, "codec", "which 'qsgd:127\\+zstd' does not send"),
        ({"secagg": True, "codec": "qsgd:0"}, "codec", "qsgd"),
        ({"secagg": True, "region_codecs": "eu=int8"}, "region_codecs", "one ring"),
        ({"secagg": True, "strategy": "scaffold"}, "secagg", "whole models"),
        ({"secagg": True, "aggregator": "median"}, "aggregator", "must be mean"),
        ({"secagg": True, "min_quorum": 2}, "min_quorum", "synchronous"),
        (
            {"secagg": True, "peft": "lora:r=4", "lora_aggregation": "svd", "model": "hf:/nowhere"},
            "lora_aggregation",
            "only the sum of the factors",
        ),
        (
            {"secagg": True, "hierarchy": True, "regions": "a:0.5,b:0.5", "lan_codec": "sign"},
            "lan_codec",
            "must be one of",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_key(overrides: dict, key: str, text: str) -> None:
    with pytest.raises(ConfigError, match=text) as info:
        load_config(overrides=overrides)
    assert info.value.key == key  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("codec", "bits", "levels", "scale"),
    [("qsgd:127", 8, 127, (127 - 10) / 0.5), ("qsgd:100", 8, 100, 100 / 0.5), ("qsgd:32", 8, 32, 32 / 0.5),
     ("qsgd:1000", 16, 1000, 1000 / 0.5), ("int8", 8, 0, 117 / 0.5), ("fp16", 16, 0, (32767 - 10) / 0.5)],
)  # fmt: skip
def test_qsgd_masks_its_levels_in_the_ring_of_its_code_width(
    codec: str, bits: int, levels: int, scale: float
) -> None:
    strategy = build_strategy(load_config(overrides={"secagg": True, "codec": codec, "secagg_clip": 0.5}))
    assert isinstance(strategy, SecAgg)
    assert (strategy.bits, strategy.levels) == (bits, levels)
    # The public scale for 10 clients: QSGD's levels over the clip, within the ring's room.
    assert strategy._scale(10) == scale  # noqa: SLF001


@pytest.mark.parametrize("codec", ["qsgd:1", "qsgd:7"])
def test_qsgd_codes_narrower_than_a_byte_are_no_ring(codec: str) -> None:
    # (error feedback refuses them first, as not contractive; the ring refuses them on its own too)
    with pytest.raises(ConfigError, match=f"{codec}'s levels in a ring of its [24]-bit codes") as info:
        secagg_ring(CodecSpec.parse(codec, key="lan_codec"), key="lan_codec")
    assert info.value.key == "lan_codec" and "use qsgd:8 or more levels" in str(info.value)


def test_a_threshold_below_a_majority_of_the_automatic_neighbourhood_is_refused() -> None:
    config = load_config(overrides={"secagg": True, "secagg_threshold": 3})
    build_strategy(config, num_clients=5)  # k = 4 neighbours: 3 is a majority
    with pytest.raises(ConfigError, match="not a majority of the 14 neighbours of 100 clients") as info:
        build_strategy(config, num_clients=100)
    assert info.value.key == "secagg_threshold"


def test_a_8_bit_ring_refuses_more_clients_than_it_can_sum() -> None:
    config = load_config(overrides={"secagg": True, "codec": "int8"})
    build_strategy(config, num_clients=125)
    with pytest.raises(ConfigError, match="8-bit ring cannot hold the sum of 126 clients") as info:
        build_strategy(config, num_clients=126)
    assert info.value.key == "codec"
