"""Unit tests of ``fedgrid.aggregation.by_name``: strategies and aggregators by name."""

from __future__ import annotations

import pytest

from fedgrid.aggregation import (
    STRATEGIES,
    BlockCoordinate,
    DiLoCo,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedProx,
    FedYogi,
    Krum,
    Mean,
    Median,
    Scaffold,
    ServerAdam,
    ServerSGD,
    StreamingDiLoCo,
    TrimmedMean,
    build_strategy_from,
    strategy_options,
)
from fedgrid.aggregation.by_name import parse_block_prefixes
from fedgrid.errors import ConfigError


def test_every_name_builds_its_class():
    expected = {
        "fedavg": FedAvg,
        "fedavgm": FedAvgM,
        "fedadam": FedAdam,
        "fedyogi": FedYogi,
        "fedadagrad": FedAdagrad,
        "fedprox": FedProx,
        "scaffold": Scaffold,
        "diloco": DiLoCo,
        "streaming-diloco": StreamingDiLoCo,
        "bcd": BlockCoordinate,
    }
    assert list(STRATEGIES) == list(expected)
    for name, cls in expected.items():
        strategy = build_strategy_from(name)
        assert type(strategy) is cls and strategy.name == name  # type: ignore[attr-defined]


def test_defaults():
    diloco = build_strategy_from("diloco")
    assert isinstance(diloco, DiLoCo)
    opt = diloco.server_optimizer
    assert isinstance(opt, ServerSGD) and (opt.lr, opt.momentum, opt.nesterov) == (0.7, 0.9, True)
    adam = build_strategy_from("fedadam")
    assert isinstance(adam, FedAdam) and isinstance(adam.server_optimizer, ServerAdam)
    assert (
        adam.server_optimizer.lr,
        adam.server_optimizer.beta1,
        adam.server_optimizer.beta2,
        adam.server_optimizer.tau,
    ) == (3e-2, 0.9, 0.99, 1e-3)
    assert build_strategy_from("fedavg").aggregator is None  # type: ignore[attr-defined]


def test_options_reach_the_strategy():
    s = build_strategy_from(
        "fedadam",
        server_lr=0.3,
        server_beta1=0.5,
        server_tau=1e-4,
        fraction_fit=0.5,
        seed=9,
        fit_config={"lr": 0.1},
    )
    assert isinstance(s, FedAdam)
    assert (s.server_optimizer.lr, s.server_optimizer.beta1, s.server_optimizer.tau) == (0.3, 0.5, 1e-4)
    assert (s.sampling.fraction_fit, s.seed, s.sampling.fit_config) == (0.5, 9, {"lr": 0.1})
    s2 = build_strategy_from("bcd", num_blocks=3, block_schedule="capacity", block_prefixes="")
    assert isinstance(s2, BlockCoordinate) and (s2.num_blocks, s2.schedule, s2.block_prefixes) == (
        3,
        "capacity",
        None,
    )
    s3 = build_strategy_from("bcd", block_prefixes="enc, head;bn")
    assert isinstance(s3, BlockCoordinate) and s3.block_prefixes == [["enc", "head"], ["bn"]]
    s4 = build_strategy_from("streaming-diloco", num_fragments=4, inner_steps=50, outer_lr=0.5)
    assert isinstance(s4, StreamingDiLoCo) and (s4.num_fragments, s4.inner_steps, s4.server_optimizer.lr) == (
        4,
        50,
        0.5,
    )


def test_none_means_default():
    s = build_strategy_from(
        "fedavgm", server_lr=None, server_momentum=None, aggregator=None, aggregator_f=None, proximal_mu=None
    )
    assert isinstance(s, FedAvgM) and s.server_optimizer.lr == 1.0


def test_aggregator_options():
    s = build_strategy_from("fedyogi", aggregator="krum", aggregator_f=2)
    assert isinstance(s.aggregator, Krum) and s.aggregator.f == 2  # type: ignore[attr-defined]
    s = build_strategy_from("bcd", aggregator="trimmed-mean", aggregator_beta=0.25)
    assert isinstance(s.aggregator, TrimmedMean) and s.aggregator.beta == 0.25  # type: ignore[attr-defined]
    s = build_strategy_from("fedavg", aggregator="mean", aggregator_weighted=False)
    assert isinstance(s.aggregator, Mean) and not s.aggregator.weighted  # type: ignore[attr-defined]
    rule = Median()
    assert build_strategy_from("scaffold", aggregator=rule).aggregator is rule  # type: ignore[attr-defined]


def test_unknown_strategy():
    with pytest.raises(ConfigError, match="unknown strategy 'fedsgd' \\(known: fedavg, fedavgm") as info:
        build_strategy_from("fedsgd")
    assert info.value.key == "strategy"


@pytest.mark.parametrize(
    "name,options,key,message",
    [
        (
            "fedavg",
            {"server_lr": 0.1},
            "server_lr",
            "does not apply to strategy 'fedavg' \\(its own options: lora_aggregation\\)",
        ),
        ("fedprox", {"outer_lr": 0.1}, "outer_lr", "its own options: proximal_mu"),
        ("fedavg", {"colour": "red"}, "colour", "does not apply"),
        ("fedadam", {"server_beta1": 1.5}, "strategy", "fedadam: beta1 must be in \\[0, 1\\)"),
        (
            "bcd",
            {"block_schedule": "greedy"},
            "strategy",
            "block_schedule must be one of per-round, cyclic, random, capacity",
        ),
        ("bcd", {"block_prefixes": "enc;;bn"}, "block_prefixes", "empty block"),
        (
            "fedavg",
            {"aggregator": "krum", "aggregator_beta": 0.1},
            "aggregator",
            "krum takes no option 'beta'",
        ),
        ("fedavg", {"aggregator": "mode"}, "aggregator", "unknown aggregator"),
        (
            "fedavg",
            {"aggregator": Median(), "aggregator_f": 1},
            "aggregator",
            "given with an aggregator instance",
        ),
        ("diloco", {"inner_steps": 0}, "strategy", "inner_steps must be at least 1"),
    ],
)
def test_bad_options(name, options, key, message):
    with pytest.raises(ConfigError, match=message) as info:
        build_strategy_from(name, **options)
    assert info.value.key == key


def test_check_preconditions_at_configuration_time():
    build_strategy_from("fedavg", aggregator="krum", aggregator_f=2).check_preconditions(num_clients=7)
    with pytest.raises(
        ConfigError, match="krum: needs more than 2f \\+ 2 = 6 updates per round to tolerate f=2, got 6"
    ) as info:
        build_strategy_from("fedavg", aggregator="krum", aggregator_f=2).check_preconditions(num_clients=6)
    assert info.value.key == "aggregator"
    with pytest.raises(ConfigError, match="trims nothing"):
        build_strategy_from(
            "fedadam", aggregator="trimmed-mean", aggregator_beta=0.1, fraction_fit=0.5
        ).check_preconditions(num_clients=10)
    with pytest.raises(ConfigError, match="multi-krum: m=8 exceeds n - f = 7"):
        build_strategy_from(
            "fedavg", aggregator="multi-krum", aggregator_f=1, aggregator_m=8
        ).check_preconditions(num_clients=8)
    for name in STRATEGIES:
        build_strategy_from(name).check_preconditions(num_clients=1)


def test_strategy_options_lists_what_is_accepted():
    options = strategy_options("fedadam")
    assert {
        "server_lr",
        "server_beta1",
        "server_beta2",
        "server_tau",
        "aggregator",
        "aggregator_f",
        "fraction_fit",
    } <= set(options)
    assert "proximal_mu" not in options
    for name in STRATEGIES:
        assert "aggregator" in strategy_options(name)


def test_parse_block_prefixes():
    assert parse_block_prefixes("conv1,conv2;fc") == [["conv1", "conv2"], ["fc"]]
    assert parse_block_prefixes(" a ; b ") == [["a"], ["b"]]
    with pytest.raises(ConfigError):
        parse_block_prefixes("a;")
