"""Builds the configured strategy: one place shared by ``fedgrid simulate`` and the coordinator."""

from __future__ import annotations

from fedgrid.aggregation import FedAvg, Strategy
from fedgrid.aggregation.selection import RegionBalancedSelector, SelectionPolicy, Selector, UniformSelector
from fedgrid.config import Config
from fedgrid.errors import ConfigError

__all__ = ["build_strategy", "build_selection"]


def build_selection(config: Config) -> SelectionPolicy:
    """The selection policy of ``config`` (count, over-selection, selector)."""
    selector: Selector = RegionBalancedSelector() if config.selector == "region-balanced" else UniformSelector()
    return SelectionPolicy(clients_per_round=config.clients_per_round, over_selection=config.over_selection, selector=selector)


def build_strategy(config: Config) -> Strategy:
    """Returns the strategy ``config.strategy`` with its options from ``config``.

    Raises:
        ConfigError: unknown strategy.
    """
    fit_config = {"local_epochs": config.local_epochs, "lr": config.lr}
    if config.strategy == "fedavg":
        strategy = FedAvg(
            fraction_fit=config.fraction_fit,
            fraction_evaluate=config.fraction_evaluate,
            min_fit_clients=1,
            seed=config.seed,
            fit_config=fit_config,
        )
        strategy.selection = build_selection(config)
        return strategy
    raise ConfigError("strategy", f"unknown strategy {config.strategy!r}")
