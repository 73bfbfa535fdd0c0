"""``build_parts``: one builder of a run's round parts for a coordinator, a region and a simulation."""

from __future__ import annotations

import pytest

from fedgrid.aggregation.secagg import SecAgg
from fedgrid.compression.spec import CodecSpec
from fedgrid.config import load_config
from fedgrid.errors import ConfigError
from fedgrid.fleet.base import Quorum
from fedgrid.fleet.bounds import UpdateBounds
from fedgrid.fleet.codec_policy import CodecPolicy
from fedgrid.server.influence import Influence
from fedgrid.server.parts import build_parts
from fedgrid.server.privacy import simulation_key

DP = {"dp_noise_multiplier": 1.0, "dp_clip": "1.0"}


def test_the_parts_are_read_from_the_config_keys() -> None:
    config = load_config(
        overrides={
            "strategy": "fedadam",
            "codec": "int8",
            "downlink_codec": "int8",
            "max_num_examples": 500,
            "max_update_norm": 3.0,
            "max_weight_ratio": 4.0,
            "min_quorum": 2,
            "min_clients": 3,
        }
    )
    parts = build_parts(config, num_clients=3, where="coordinator")
    assert type(parts.strategy).__name__ == "FedAdam"
    assert parts.bounds == UpdateBounds(max_num_examples=500, max_update_norm=3.0)
    assert parts.codec_policy.default == CodecSpec.parse("int8")
    assert parts.downlink_codec == CodecSpec.parse("int8")
    assert parts.rules.quorum == Quorum(min_quorum=2, grace_s=config.grace_s, max_staleness=config.max_staleness,
                                        staleness_exponent=config.staleness_exponent)  # fmt: skip
    assert parts.rules.influence == Influence(
        max_weight_ratio=4.0, client_quotas={}, max_update_ratio=config.max_update_ratio
    )
    assert parts.rules.privacy is None  # DP off


def test_privacy_is_keyed_by_who_runs_the_rounds() -> None:
    config = load_config(overrides={**DP, "seed": 7})
    simulated = build_parts(config, num_clients=2, where="simulation").rules.privacy
    assert simulated is not None and simulated.key == simulation_key(7)  # reproducible from the seed
    a = build_parts(config, num_clients=2, where="coordinator").rules.privacy
    b = build_parts(config, num_clients=2, where="coordinator").rules.privacy
    assert a is not None and b is not None and a.key != b.key and simulation_key(7) not in (a.key, b.key)
    # A region's rounds have neither DP nor quorum: the global coordinator applies them.
    region = build_parts(config, num_clients=2, where="region")
    assert region.rules.privacy is None and region.rules.quorum is None


def test_a_fixed_uplink_replaces_the_configured_codecs() -> None:
    config = load_config(overrides={"codec": "int8", "region_codecs": "eu=topk:0.1"})
    lan = CodecSpec.parse("fp16")
    assert build_parts(config, num_clients=1, where="region", uplink=lan).codec_policy == CodecPolicy(
        default=lan
    )


def test_a_simulated_hierarchy_aggregates_securely_inside_its_regions_not_across_them() -> None:
    flat = load_config(overrides={"secagg": True})
    assert isinstance(build_parts(flat, num_clients=3, where="simulation").strategy, SecAgg)
    tiered = load_config(overrides={"secagg": True, "hierarchy": True, "regions": "eu:0.5,us:0.5"})
    assert not isinstance(build_parts(tiered, num_clients=3, where="simulation").strategy, SecAgg)


def test_a_bad_option_fails_naming_its_key() -> None:
    config = load_config(overrides={"strategy": "fedavg", "aggregator": "krum", "aggregator_f": 2})
    with pytest.raises(ConfigError, match="aggregator"):
        build_parts(config, num_clients=6, where="coordinator")  # Krum needs n > 2f + 2
