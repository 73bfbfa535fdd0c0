"""Builds the configured strategy: one place shared by ``fedgrid simulate`` and the coordinator."""

from __future__ import annotations

from fedgrid.aggregation import Strategy
from fedgrid.aggregation.registry import build_strategy_from
from fedgrid.aggregation.selection import (
    CapabilityFilter,
    RegionBalancedSelector,
    SelectionPolicy,
    Selector,
    UniformSelector,
)
from fedgrid.capabilities import parse_size
from fedgrid.config import Config

__all__ = ["build_strategy", "build_selection", "build_capability_filter"]


def build_selection(config: Config) -> SelectionPolicy:
    """The selection policy of ``config`` (count, over-selection, selector)."""
    selector: Selector = (
        RegionBalancedSelector() if config.selector == "region-balanced" else UniformSelector()
    )
    return SelectionPolicy(
        clients_per_round=config.clients_per_round, over_selection=config.over_selection, selector=selector
    )


def build_capability_filter(config: Config) -> CapabilityFilter | None:
    """The clients a coordinator gives tasks to, by what they report at Join
    (``require_device``, ``min_accelerators``, ``min_client_memory``); ``None``: every client."""
    memory = parse_size(config.min_client_memory, what="min_client_memory")
    if not (config.require_device or config.min_accelerators or memory):
        return None
    devices = (config.require_device,) if config.require_device else ()
    return CapabilityFilter(
        min_memory_bytes=memory, min_accelerators=config.min_accelerators, devices=devices
    )


def build_strategy(config: Config, *, num_clients: int | None = None) -> Strategy:
    """Returns the strategy ``config.strategy`` with its options from ``config``.

    Args:
        config: the run configuration (strategy name, its options, sampling, selection).
        num_clients: when given, the strategy's preconditions are checked for this many
            clients (``fedgrid simulate``: all its clients; the coordinator: ``min_clients``),
            so that e.g. Krum with n <= 2f + 2 fails before any work starts.

    Raises:
        ConfigError: unknown strategy or aggregator, an option that does not apply or is out
            of range, or a precondition that ``num_clients`` clients cannot meet.
    """
    fit_config = {"local_epochs": config.local_epochs, "lr": config.lr}
    strategy = build_strategy_from(
        config.strategy,
        policy=build_selection(config),
        fraction_fit=config.fraction_fit,
        fraction_evaluate=config.fraction_evaluate,
        min_fit_clients=1,
        seed=config.seed,
        fit_config=fit_config,
        **config.strategy_options(),
    )
    if num_clients is not None:
        strategy.check_preconditions(num_clients=num_clients)
    return strategy
