"""The ``http`` config keys: a coordinator's, never ``fedgrid simulate``'s; checked before any work."""

from __future__ import annotations

import pytest

from fedgrid.cli import COORDINATOR_KEYS, SIMULATE_KEYS, build_parser
from fedgrid.cli.support import config_from
from fedgrid.config import load_config
from fedgrid.errors import ConfigError


def test_http_keys_are_coordinator_and_client_flags_only():
    assert {"http", "http_token_file", "http_linger_s"} <= set(COORDINATOR_KEYS)
    assert not {"http", "http_token_file", "http_linger_s"} & set(SIMULATE_KEYS)
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["simulate", "--http", "127.0.0.1:0"])
    args = parser.parse_args(["coordinator", "--http", "127.0.0.1:9100", "--http-token-file", "t"])
    assert (args.http, args.http_token_file) == ("127.0.0.1:9100", "t")
    args = parser.parse_args(["coordinator", "--http", "127.0.0.1:0", "--http-linger-s", "30"])
    assert config_from(args, COORDINATOR_KEYS).http_linger_s == 30.0
    args = parser.parse_args(["client", "--coordinator", "x:1", "--http", "127.0.0.1:0"])
    assert args.http == "127.0.0.1:0"
    args = parser.parse_args(["status", "127.0.0.1:9100", "--watch", "--interval", "0.5"])
    assert (args.address, args.watch, args.interval) == ("127.0.0.1:9100", True, 0.5)


@pytest.mark.parametrize(
    "overrides, key, message",
    [
        ({"http": "9100"}, "http", "expected HOST:PORT"),
        ({"http": "127.0.0.1:99999"}, "http", "expected HOST:PORT"),
        ({"http_token_file": "token"}, "http_token_file", "only with http"),
        (
            {"http": "127.0.0.1:0", "http_linger_s": -1.0},
            "http_linger_s",
            "finite number of seconds at least 0",
        ),
        ({"http": "127.0.0.1:0", "http_linger_s": float("inf")}, "http_linger_s", "finite number"),
        ({"http": "127.0.0.1:0", "http_linger_s": float("nan")}, "http_linger_s", "finite number"),
    ],
)
def test_bad_http_settings_name_the_key(overrides, key, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(overrides=overrides)
    assert info.value.key == key


def test_http_is_off_by_default():
    assert load_config().http == ""


def test_a_finished_run_holds_its_final_state_ten_seconds_at_most_by_default():
    assert load_config().http_linger_s == 10.0
    assert load_config(overrides={"http": "127.0.0.1:0", "http_linger_s": 0}).http_linger_s == 0.0
