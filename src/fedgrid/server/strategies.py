"""Builds the configured strategy: one place shared by ``fedgrid simulate`` and the coordinator.

``strategy`` names a built-in (``fedavg``, ...) or your own as ``MODULE:ATTRIBUTE``: a
``fedgrid.Strategy`` subclass, or a factory returning one (``custom_strategy``), loaded with the
same checks as ``--app`` (``fedgrid.plugins``), so a strategy prototyped in simulation deploys
unchanged behind a coordinator.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from fedgrid.aggregation import Strategy
from fedgrid.aggregation.by_name import build_strategy_from, strategy_role
from fedgrid.aggregation.selection import (
    CapabilityFilter,
    RegionBalancedSelector,
    Sampling,
    SelectionPolicy,
    Selector,
    UniformSelector,
)
from fedgrid.capabilities import parse_size
from fedgrid.config import Config
from fedgrid.errors import ConfigError
from fedgrid.plugins import is_custom_strategy, load_object

__all__ = [
    "build_strategy",
    "codec_strategy_defaults",
    "build_selection",
    "build_capability_filter",
    "custom_strategy",
    "RUN_KEYS",
]

log = logging.getLogger(__name__)

#: What a custom strategy's constructor is offered, by parameter name: the run's keys that every
#: built-in strategy gets too. ``sampling`` is the ``Sampling`` a built-in gets (a subclass of
#: ``FedAvg`` takes it as it is); its parts are offered too: ``fit_config`` (the run's
#: ``local_epochs`` and ``lr``) and ``policy`` (``clients_per_round``, ``over_selection``, ``selector``).
RUN_KEYS = ("sampling", "seed", "fraction_fit", "fraction_evaluate", "fit_config", "policy")


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


def build_strategy(
    config: Config, *, num_clients: int | None = None, given: Strategy | None = None
) -> Strategy:
    """Returns the strategy ``config.strategy`` with its options from ``config`` (a built-in by
    name, or your own ``MODULE:ATTRIBUTE``: ``custom_strategy``), or ``given``.

    Args:
        config: the run configuration (strategy name, its options, sampling, selection).
        given: a strategy built by the caller (``run_coordinator(strategy=...)``), used as it is.
        num_clients: when given, the strategy's preconditions are checked for this many
            clients (``fedgrid simulate``: all its clients; the coordinator: ``min_clients``),
            so that e.g. Krum with n <= 2f + 2 fails before any work starts.

    Raises:
        ConfigError: unknown strategy or aggregator, an option that does not apply or is out
            of range, or a precondition that ``num_clients`` clients cannot meet.
    """
    if given is not None or is_custom_strategy(config.strategy):
        strategy = given if given is not None else custom_strategy(config)
        if num_clients is not None:
            strategy.check_preconditions(num_clients=num_clients)
        return strategy
    fit_config = {"local_epochs": config.local_epochs, "lr": config.lr}
    chosen = codec_strategy_defaults(config)
    if chosen:  # the written config leaves these keys unset: say what the run uses
        log.info(
            "codec %s sets %s's %s (set the keys to choose others)",
            config.codec,
            config.strategy,
            ", ".join(f"{key} = {value!r}" for key, value in chosen.items()),
        )
    strategy = build_strategy_from(
        config.strategy,
        policy=build_selection(config),
        fraction_fit=config.fraction_fit,
        fraction_evaluate=config.fraction_evaluate,
        min_fit_clients=1,
        seed=config.seed,
        fit_config=fit_config,
        **{**chosen, **config.strategy_options()},
    )
    if config.secagg:  # SecAgg+ phases around the strategy (fedgrid.aggregation.secagg)
        strategy = secagg_strategy(config, strategy)
    if num_clients is not None:
        strategy.check_preconditions(num_clients=num_clients)
    return strategy


def codec_strategy_defaults(config: Config) -> dict[str, Any]:
    """The strategy options the uplink codec asks for (``Codec.auto_strategy``, by what the
    strategy declares it makes of the updates: ``Strategy.update_role``) where the config
    leaves them unset: ``sparseloco`` under an outer optimizer (``diloco``, ``streaming-diloco``)
    takes SparseLoCo's outer step (plain SGD, no outer momentum: its error feedback with
    momentum is the momentum; ``sender-mean``). Under SecAgg+ none (the server sees only the sum).

    Returns:
        Option name -> value, for the options of ``config.strategy`` the codec names and the
        config leaves ``None``; empty for most codecs.
    """
    if config.secagg or is_custom_strategy(config.strategy):
        return {}
    wanted = config.codecs.uplink.decoder.auto_strategy.get(strategy_role(config.strategy), {})
    return {key: value for key, value in wanted.items() if getattr(config, key) is None}


def secagg_strategy(config: Config, strategy: Strategy) -> Strategy:
    """``strategy`` under SecAgg+ with the run's secagg keys; the ring is the codec's width."""
    from fedgrid.aggregation.secagg import SecAgg
    from fedgrid.config_privacy import parse_dp_clip
    from fedgrid.config_secagg import secagg_ring

    # DP under SecAgg+: the clients clip and add the noise, and sum their unclipped bits (docs/privacy.rst).
    dp_clip, adaptive = parse_dp_clip(config.dp_clip) if config.dp_noise_multiplier else (0.0, False)
    bits, levels = secagg_ring(config.codecs.uplink)
    return SecAgg(
        strategy,
        bits=bits,
        clip=config.secagg_clip,
        levels=levels,
        neighbours=config.secagg_neighbours,
        threshold=config.secagg_threshold,
        seed=config.seed,
        dp_noise_multiplier=config.dp_noise_multiplier,
        dp_clip=dp_clip,
        dp_adaptive=adaptive,
    )


def custom_strategy(config: Config) -> Strategy:
    """The strategy ``config.strategy = "MODULE:ATTRIBUTE"`` names, built once per run.

    ``ATTRIBUTE`` (a ``Strategy`` subclass or a factory) is called with keyword arguments: of
    ``RUN_KEYS``, those its signature names; and every strategy option the run sets
    (``server_lr``, ``aggregator``, ...: ``Config.strategy_options``), which its signature must
    take, by name or as ``**kwargs``, as a built-in strategy refuses an option it has no use for.

    Raises:
        ConfigError: (key ``strategy``) the module or attribute cannot be loaded, building it
            failed, or it did not build a ``fedgrid.Strategy``; (the option's key) an option
            set that it does not take.
    """
    spec = config.strategy
    factory = load_object(spec, key="strategy")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a callable without a signature (a C type): offer nothing
        params = {}  # type: ignore[assignment]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    sampling = Sampling(
        fraction_fit=config.fraction_fit,
        fraction_evaluate=config.fraction_evaluate,
        seed=config.seed,
        fit_config={"local_epochs": config.local_epochs, "lr": config.lr},
        policy=build_selection(config),
    )
    offered = {"sampling": sampling, **{k: getattr(sampling, k) for k in RUN_KEYS[1:]}}
    kwargs = {k: v for k, v in offered.items() if k in params}
    for key, value in config.strategy_options().items():
        if key not in params and not takes_any:
            own = ", ".join(n for n in params if n not in RUN_KEYS) or "none"
            raise ConfigError(key, f"does not apply to strategy {spec!r} (its parameters: {own})")
        kwargs[key] = value
    try:
        strategy = factory(**kwargs)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError("strategy", f"building {spec!r} failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(strategy, Strategy):
        raise ConfigError(
            "strategy",
            f"{spec!r} built a {type(strategy).__name__}, not a fedgrid.Strategy (see docs/algorithms.rst)",
        )
    return strategy
