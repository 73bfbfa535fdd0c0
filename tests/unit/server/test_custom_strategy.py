"""``strategy = "MODULE:CLASS"``: your own strategy, loaded with the same checks as ``--app`` and
built with the run's keys its constructor names; ``run_coordinator(strategy=...)`` records it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fedgrid.aggregation import FedAvg
from fedgrid.config import load_config
from fedgrid.errors import ConfigError
from fedgrid.server.serve import _with_strategy
from fedgrid.server.strategies import build_strategy

ROOT = Path(__file__).resolve().parents[3]
SPEC = "examples.custom_strategy:ServerLRAvg"


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT))  # `examples` imports from the folder holding it
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [m for m in sys.modules if m.startswith("mystrategy_")]:
        del sys.modules[name]


def test_the_example_strategy_is_built_with_the_run_keys_it_names():
    config = load_config(overrides={"strategy": SPEC, "seed": 7, "fraction_fit": 0.7, "server_lr": 0.5})
    strategy = build_strategy(config, num_clients=3)
    assert type(strategy).__module__ == "examples.custom_strategy"
    assert (strategy.seed, strategy.fraction_fit, strategy.server_lr) == (7, 0.7, 0.5)
    assert strategy.client_lr == 0.1  # not a run key: its own default


def test_a_factory_gets_the_built_in_strategies_run_keys(tmp_path):
    (tmp_path / "mystrategy_factory.py").write_text(
        "import dataclasses\n"
        "from fedgrid.aggregation import FedAvg\n"
        "def make(*, sampling, fit_config, **options):\n"
        "    return FedAvg(sampling=dataclasses.replace(sampling, fit_config={**fit_config, **options}))\n"
    )
    overrides = {"local_epochs": 3, "proximal_mu": 0.5, "seed": 4, "clients_per_round": 2}
    strategy = build_strategy(load_config(overrides={"strategy": "mystrategy_factory:make", **overrides}))
    assert isinstance(strategy, FedAvg)
    assert strategy.sampling.fit_config == {"local_epochs": 3, "lr": 0.1, "proximal_mu": 0.5}
    assert (strategy.sampling.seed, strategy.sampling.policy.clients_per_round) == (4, 2)


@pytest.mark.parametrize(
    "spec, overrides, key, words",
    [
        (
            "examples.custom_strategy:ServerLRAvg",
            {"proximal_mu": 0.1},
            "proximal_mu",
            "does not apply to strategy",
        ),
        ("examples.custom_strategy:NoSuch", {}, "strategy", "has no attribute 'NoSuch'"),
        ("mystrategy_missing:Cls", {}, "strategy", "no module 'mystrategy_missing' in the current directory"),
        ("examples.custom_strategy:main", {}, "strategy", "built a float, not a fedgrid.Strategy"),
        (
            "examples.custom_strategy:ServerLRAvg",
            {"fraction_fit": 1.0, "server_lr": 3.0},
            "strategy",
            "ValueError",
        ),
    ],
)
def test_a_strategy_that_cannot_be_built_names_the_key(spec, overrides, key, words, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fedgrid"])  # `main` parses argv: a short run, if it gets that far
    config = load_config(overrides={"strategy": spec, **overrides})
    if spec.endswith(":main"):
        import examples.custom_strategy as example

        monkeypatch.setattr(example, "main", lambda **kwargs: 0.5)
    with pytest.raises(ConfigError, match=words) as info:
        build_strategy(config)
    assert info.value.key == key


@pytest.mark.parametrize(
    "spec, words",
    [
        ("examples.custom_strategy:", "expected MODULE:ATTRIBUTE"),
        ("servrlravg", "unknown strategy 'servrlravg'"),
    ],
)
def test_a_malformed_strategy_is_refused_when_the_config_is_built(spec, words):
    with pytest.raises(ConfigError, match=words) as info:
        load_config(overrides={"strategy": spec})
    assert info.value.key == "strategy"


def test_min_quorum_takes_a_built_in_strategy():
    with pytest.raises(ConfigError, match="takes a built-in strategy") as info:
        load_config(overrides={"strategy": SPEC, "min_quorum": 2, "min_clients": 3})
    assert info.value.key == "min_quorum"


def test_run_coordinator_records_the_strategy_it_was_given():
    from examples.custom_strategy import ServerLRAvg

    config = _with_strategy(load_config(), ServerLRAvg(server_lr=0.5))
    assert config.strategy == SPEC
    with pytest.raises(ConfigError, match="set it on the strategy given to run_coordinator") as info:
        _with_strategy(load_config(overrides={"server_lr": 0.5, "strategy": "fedadam"}), ServerLRAvg())
    assert info.value.key == "server_lr"
    with pytest.raises(ConfigError, match="expected a fedgrid.Strategy, got str"):
        _with_strategy(load_config(), "fedavg")  # type: ignore[arg-type]
