"""Unit tests of ``fedgrid.simulation.heterogeneity``: the stated availability, speed and region model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fedgrid.config import load_config
from fedgrid.errors import ConfigError
from fedgrid.simulation.heterogeneity import ClientProfiles, load_trace, parse_regions, parse_speed
from fedgrid.simulation.tasks import check_config


def test_defaults_are_homogeneous():
    profiles = ClientProfiles.from_config(load_config(overrides={"clients": 5}))
    assert profiles.homogeneous and profiles.num_clients == 5
    assert all(profiles.available(i, r) for i in range(5) for r in range(1, 20))
    assert [profiles.region(i) for i in range(5)] == [""] * 5
    assert [profiles.speed(i) for i in range(5)] == [1.0] * 5


def test_dropout_rate_over_many_rounds():
    p, clients, rounds = 0.3, 50, 200
    profiles = ClientProfiles(clients, seed=3, dropout_prob=p)
    draws = np.array([[profiles.available(i, r) for r in range(1, rounds + 1)] for i in range(clients)])
    n = draws.size  # 10,000 Bernoulli draws: standard error of the rate 0.0046
    assert abs((1 - draws.mean()) - p) < 4 * math.sqrt(p * (1 - p) / n)
    # i.i.d. per client: every client's own rate is near p too (200 draws each, 4.5 sigma)
    per_client = 1 - draws.mean(axis=1)
    assert np.all(np.abs(per_client - p) < 4.5 * math.sqrt(p * (1 - p) / rounds))
    # ... and per round
    assert np.all(np.abs((1 - draws.mean(axis=0)) - p) < 4.5 * math.sqrt(p * (1 - p) / clients))


def test_dropouts_reproducible_and_seed_dependent():
    a = ClientProfiles(20, seed=1, dropout_prob=0.5)
    b = ClientProfiles(20, seed=1, dropout_prob=0.5)
    c = ClientProfiles(20, seed=2, dropout_prob=0.5)
    grid = lambda prof: [prof.available(i, r) for i in range(20) for r in range(1, 11)]  # noqa: E731
    assert grid(a) == grid(b)
    assert grid(a) != grid(c)
    # a client's draws do not depend on the federation's size or on who else was asked
    big = ClientProfiles(40, seed=1, dropout_prob=0.5)
    assert [big.available(3, r) for r in range(1, 11)] == [a.available(3, r) for r in range(1, 11)]


def test_trace_semantics_json(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"0": [1, 3], "2": [], "4": [2, 3, 4]}))
    assert load_trace(path) == {0: frozenset({1, 3}), 2: frozenset(), 4: frozenset({2, 3, 4})}
    profiles = ClientProfiles(5, trace=load_trace(path))
    table = [[profiles.available(i, r) for r in range(1, 6)] for i in range(5)]
    assert table == [
        [True, False, True, False, False],  # listed: only its rounds
        [True] * 5,  # not in the trace: always
        [False] * 5,  # listed with no rounds: never
        [True] * 5,
        [False, True, True, True, False],
    ]


def test_trace_semantics_csv_and_dropout_combined(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("client,round\n0,1\n0,2\n1,\n2,2\n")
    assert load_trace(path) == {0: frozenset({1, 2}), 1: frozenset(), 2: frozenset({2})}
    trace = load_trace(path)
    both = ClientProfiles(3, seed=0, trace=trace, dropout_prob=0.5)
    drop = ClientProfiles(3, seed=0, dropout_prob=0.5)
    only = ClientProfiles(3, seed=0, trace=trace)
    for i in range(3):
        for r in range(1, 5):
            assert both.available(i, r) == (only.available(i, r) and drop.available(i, r))


@pytest.mark.parametrize(
    "text,words",
    [
        ('{"0": [1, 2', "is not valid JSON"),
        ('{"0": 3}', "needs a list of rounds"),
        ('{"x": [1]}', "must be whole numbers"),
        ('{"0": [0]}', "rounds at 1"),
        ("client,round\n1,2,3\n", "expected client,round"),
        ("0,a\n", "must be whole numbers"),
    ],
)
def test_bad_traces_name_the_key(tmp_path, text, words):
    path = tmp_path / "trace.txt"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words) as info:
        load_trace(path)
    assert info.value.key == "availability_trace"
    with pytest.raises(ConfigError) as info:
        check_config(load_config(overrides={"availability_trace": str(path)}))
    assert info.value.key == "availability_trace"
    with pytest.raises(ConfigError, match="cannot read") as info:
        check_config(load_config(overrides={"availability_trace": str(tmp_path / "missing.json")}))
    assert info.value.key == "availability_trace"


def test_region_proportions_exact_and_reproducible():
    profiles = ClientProfiles(100, seed=5, regions="us:0.5,eu:0.3,ap:0.2")
    labels = [profiles.region(i) for i in range(100)]
    assert {r: labels.count(r) for r in set(labels)} == {"us": 50, "eu": 30, "ap": 20}
    assert labels == [
        ClientProfiles(100, seed=5, regions="us:0.5,eu:0.3,ap:0.2").region(i) for i in range(100)
    ]
    assert labels != [
        ClientProfiles(100, seed=6, regions="us:0.5,eu:0.3,ap:0.2").region(i) for i in range(100)
    ]
    assert labels[:50] != ["us"] * 50  # dealt in a seeded permutation, not in blocks
    # shares not summing to 1 are normalized; counts by largest remainder
    odd = ClientProfiles(7, seed=0, regions="a:2,b:1")
    got = [odd.region(i) for i in range(7)]
    assert (got.count("a"), got.count("b")) == (5, 2)  # 4.67 -> 5, 2.33 -> 2
    assert not odd.homogeneous


def test_speed_and_train_seconds():
    const = ClientProfiles(4, speed="2.0", examples_per_second=500.0, local_epochs=3)
    assert const.train_seconds(1, 1000) == pytest.approx(1000 * 3 / (500.0 * 2.0))
    profiles = ClientProfiles(2000, seed=9, speed="lognormal:0.5", examples_per_second=1000.0, local_epochs=1)
    speeds = np.array([profiles.speed(i) for i in range(2000)])
    log_speeds = np.log(speeds)
    assert abs(log_speeds.mean()) < 4 * 0.5 / math.sqrt(2000)  # median 1
    assert log_speeds.std() == pytest.approx(0.5, rel=0.08)
    assert profiles.train_seconds(7, 200) == pytest.approx(200 / (1000.0 * speeds[7]))
    again = ClientProfiles(10, seed=9, speed="lognormal:0.5")
    assert [again.speed(i) for i in range(10)] == list(speeds[:10])  # per-client draws: independent of N
    with pytest.raises(IndexError):
        profiles.speed(2000)


def test_from_config_reads_every_key(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text('{"1": [2]}')
    config = load_config(
        overrides={
            "clients": 10,
            "seed": 4,
            "dropout_prob": 0.2,
            "availability_trace": str(trace),
            "speed": "lognormal:1",
            "regions": "eu:1",
            "examples_per_second": 250.0,
            "local_epochs": 2,
        }
    )
    profiles = ClientProfiles.from_config(config)
    assert (
        profiles.num_clients == 10 and profiles.dropout_prob == 0.2 and profiles.trace == {1: frozenset({2})}
    )
    assert [profiles.region(i) for i in range(10)] == ["eu"] * 10
    assert profiles.train_seconds(0, 500) == pytest.approx(500 * 2 / (250.0 * profiles.speed(0)))
    assert not profiles.available(1, 1)


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("dropout_prob", 1.0, r"must be in \[0, 1\)"),
        ("dropout_prob", -0.1, r"must be in \[0, 1\)"),
        ("speed", "fast", "expected a number or lognormal:SIGMA"),
        ("speed", "0", "must be positive"),
        ("speed", "lognormal:x", "lognormal needs a number"),
        ("speed", "lognormal:-1", "sigma must be finite and at least 0"),
        ("regions", "us:0.5,eu", "expected LABEL:SHARE"),
        ("regions", "us:0", "expected LABEL:SHARE with a positive share"),
        ("regions", "us:1,us:2", "listed twice"),
        ("examples_per_second", 0.0, "must be positive"),
    ],
)
def test_bad_values_name_the_key(key, value, words):
    with pytest.raises(ConfigError, match=words) as info:
        check_config(load_config(overrides={key: value}))
    assert info.value.key == key


def test_parsers():
    assert parse_speed("1.5") == ("constant", 1.5)
    assert parse_speed("lognormal:0.25") == ("lognormal", 0.25)
    assert parse_regions("") == []
    assert parse_regions(" us : 3 , eu:1") == [("us", 0.75), ("eu", 0.25)]
