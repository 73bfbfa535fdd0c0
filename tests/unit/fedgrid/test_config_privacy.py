"""The differential privacy keys: flags of simulate and coordinator, TOML keys, and bad values
named (issue 28)."""

from __future__ import annotations

import pytest

from fedgrid.cli import support
from fedgrid.config import load_config, parse_flags
from fedgrid.config_privacy import parse_dp_clip
from fedgrid.errors import ConfigError

DP = {"dp_noise_multiplier": 1.1, "dp_clip": "1.0"}


def test_the_keys_come_from_flags_and_toml(tmp_path):
    flags = parse_flags(
        {"dp_noise_multiplier": "1.1", "dp_clip": "adaptive:0.5", "dp_epsilon": "8", "dp_accountant": "pld"}
    )
    config = load_config(overrides=flags)
    assert (config.dp_noise_multiplier, config.dp_clip, config.dp_epsilon) == (1.1, "adaptive:0.5", 8.0)
    assert config.dp_accountant == "pld" and config.dp_delta == 1e-5
    path = tmp_path / "run.toml"
    path.write_text('dp_noise_multiplier = 2\ndp_clip = "adaptive"\ndp_delta = 1e-6\n')
    config = load_config(path)
    assert (config.dp_noise_multiplier, config.dp_delta) == (2.0, 1e-6)
    for key in ("dp_noise_multiplier", "dp_clip", "dp_epsilon", "dp_delta", "dp_accountant", "dp_noise_key"):
        assert key in support.SIMULATE_KEYS and key in support.COORDINATOR_KEYS, key
        assert key not in support.REGION_KEYS, key  # not wired in fedgrid region yet


def test_the_clip_is_a_number_or_adaptive():
    assert parse_dp_clip("1.5") == (1.5, False)
    assert parse_dp_clip("adaptive") == (0.1, True)
    assert parse_dp_clip("adaptive:0.5") == (0.5, True)
    for bad in ("", "x", "-1", "inf", "adaptive:0", "1:2", "adaptive:x"):
        with pytest.raises(ConfigError, match="dp_clip"):
            parse_dp_clip(bad)


@pytest.mark.parametrize(
    "overrides, key, problem",
    [
        ({"dp_noise_multiplier": -1.0}, "dp_noise_multiplier", "at least 0"),
        ({"dp_clip": "1.0"}, "dp_clip", "needs dp_noise_multiplier above 0"),
        ({"dp_epsilon": 8.0}, "dp_epsilon", "needs dp_noise_multiplier above 0"),
        ({"dp_noise_multiplier": 1.0}, "dp_clip", "must be set with dp_noise_multiplier"),
        ({**DP, "dp_delta": 0.0}, "dp_delta", "in \\(0, 1\\)"),
        ({**DP, "dp_epsilon": -1.0}, "dp_epsilon", "at least 0"),
        ({**DP, "dp_accountant": "prv"}, "dp_accountant", "unknown accountant 'prv'"),
        ({**DP, "strategy": "scaffold"}, "dp_noise_multiplier", "got strategy 'scaffold'"),
        ({**DP, "aggregator": "median"}, "aggregator", "needs the mean"),
        ({**DP, "min_quorum": 2}, "min_quorum", "synchronous"),
        ({**DP, "dp_noise_key": "k", "secagg": True}, "dp_noise_key", "each client keys its own share"),
        ({**DP, "dp_noise_key": "/nonexistent/key"}, "dp_noise_key", "cannot read"),
    ],
)
def test_a_bad_value_is_named(overrides, key, problem):
    with pytest.raises(ConfigError, match=f"'{key}': .*{problem}"):
        load_config(overrides=overrides)


def test_a_short_noise_key_is_refused(tmp_path):
    short = tmp_path / "key"
    short.write_bytes(b"x" * 16)
    with pytest.raises(ConfigError, match="'dp_noise_key': .* holds 16 bytes, at least 32"):
        load_config(overrides={**DP, "dp_noise_key": str(short)})


def test_dp_with_secagg_is_accepted_with_a_fixed_clip():
    config = load_config(overrides={**DP, "secagg": True, "dp_epsilon": 8.0})
    assert config.secagg and config.dp_noise_multiplier == 1.1 and config.dp_clip == "1.0"
