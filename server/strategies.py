"""Builds the configured strategy: one place shared by ``fedgrid simulate`` and the coordinator."""

from __future__ import annotations

from fedgrid.aggregation import FedAvg, Strategy
from fedgrid.config import Config
from fedgrid.errors import ConfigError

__all__ = ["build_strategy"]


def build_strategy(config: Config) -> Strategy:
    """Returns the strategy ``config.strategy`` with its options from ``config``.

    Raises:
        ConfigError: unknown strategy.
    """
    fit_config = {"local_epochs": config.local_epochs, "lr": config.lr}
    if config.strategy == "fedavg":
        return FedAvg(
            fraction_fit=config.fraction_fit,
            fraction_evaluate=config.fraction_evaluate,
            min_fit_clients=1,
            seed=config.seed,
            fit_config=fit_config,
        )
    raise ConfigError("strategy", f"unknown strategy {config.strategy!r}")
