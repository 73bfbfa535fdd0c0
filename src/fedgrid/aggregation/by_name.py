"""Strategies and aggregators by name: what ``--strategy NAME`` and ``--aggregator NAME`` select.

``build_strategy_from(name, **options)`` takes the run configuration's keys as keyword
options (``server_lr``, ``aggregator``, ``aggregator_f``, ...). An option whose value is
``None`` is "not set" and leaves the strategy's default; an option set for a strategy it
does not apply to is an error, so ``--strategy fedavg --server-lr 0.1`` fails loudly
instead of silently doing nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from fedgrid.aggregation.base import Aggregator, Strategy
from fedgrid.aggregation.bcd import BlockCoordinate
from fedgrid.aggregation.clipping import CenteredClip, NormClip
from fedgrid.aggregation.diloco import DiLoCo, StreamingDiLoCo
from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.fedopt import FedAdagrad, FedAdam, FedAvgM, FedYogi
from fedgrid.aggregation.fedprox import FedProx
from fedgrid.aggregation.mean import Mean
from fedgrid.aggregation.robust import Krum, Median, MultiKrum, TrimmedMean
from fedgrid.aggregation.scaffold import Scaffold
from fedgrid.aggregation.selection import Sampling, SelectionPolicy
from fedgrid.aggregation.sender_mean import SenderMean
from fedgrid.errors import ConfigError
from fedgrid.types import UpdateRole

__all__ = [
    "AGGREGATORS",
    "STRATEGIES",
    "COMMON_OPTIONS",
    "AGGREGATOR_OPTIONS",
    "build_aggregator",
    "build_strategy_from",
    "strategy_options",
    "strategy_role",
    "parse_block_prefixes",
]

#: Aggregator names accepted by ``build_aggregator`` (``--aggregator``), with their constructors.
AGGREGATORS: dict[str, Callable[..., Aggregator]] = {
    "mean": Mean,
    "median": Median,
    "trimmed-mean": TrimmedMean,
    "krum": Krum,
    "multi-krum": MultiKrum,
    "norm-clip": NormClip,
    "centered-clip": CenteredClip,
    "sender-mean": SenderMean,
}

_AGGREGATOR_PARAMS: dict[str, tuple[str, ...]] = {
    "mean": ("weighted",),
    "median": ("weighted",),
    "trimmed-mean": ("beta", "weighted"),
    "krum": ("f", "bucket_size", "resamplings"),
    "multi-krum": ("f", "m", "weighted"),
    "norm-clip": ("bound", "weighted"),
    "centered-clip": ("tau", "iterations", "weighted"),
    "sender-mean": (),
}

#: Strategy names accepted by ``build_strategy_from`` (``--strategy``), with their constructors.
STRATEGIES: dict[str, Callable[..., Strategy]] = {
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

#: Options every strategy takes: its ``Sampling``.
COMMON_OPTIONS = ("fraction_fit", "min_fit_clients", "fraction_evaluate", "seed", "fit_config")
#: Options of the robust aggregator, for every strategy: ``aggregator`` and ``aggregator_<param>``.
AGGREGATOR_OPTIONS = ("aggregator",) + tuple(
    f"aggregator_{p}" for p in sorted({p for params in _AGGREGATOR_PARAMS.values() for p in params})
)

_DILOCO_OPTIONS = (
    "outer_lr",
    "outer_momentum",
    "inner_steps",
    "inner_lr",
    "sync_delay_steps",
    "merge_alpha",
    "inner_time_s",
)
_STRATEGY_OPTIONS: dict[str, tuple[str, ...]] = {
    "fedavg": ("lora_aggregation",),
    "fedavgm": ("server_lr", "server_momentum", "server_nesterov"),
    "fedadam": ("server_lr", "server_beta1", "server_beta2", "server_tau"),
    "fedyogi": ("server_lr", "server_beta1", "server_beta2", "server_tau"),
    "fedadagrad": ("server_lr", "server_beta1", "server_tau"),
    "fedprox": ("proximal_mu", "lora_aggregation"),
    "scaffold": ("server_lr", "total_clients"),
    "diloco": _DILOCO_OPTIONS,
    "streaming-diloco": _DILOCO_OPTIONS + ("num_fragments",),
    "bcd": ("num_blocks", "block_prefixes", "block_schedule"),
}


def build_aggregator(name: str, **params: Any) -> Aggregator:
    """The aggregator ``name`` with ``params`` (``None`` values mean "the default").

    Options: ``mean`` (weighted), ``median`` (weighted), ``trimmed-mean`` (beta, weighted),
    ``krum`` (f, bucket_size, resamplings), ``multi-krum`` (f, m, weighted), ``norm-clip`` (bound, weighted),
    ``centered-clip`` (tau, iterations, weighted).

    Raises:
        ConfigError: (key ``aggregator``) unknown name, an option the rule does not take,
            a missing required option, or a value out of range.
    """
    if name not in AGGREGATORS:
        raise ConfigError("aggregator", f"unknown aggregator {name!r} (known: {', '.join(AGGREGATORS)})")
    given = {k: v for k, v in params.items() if v is not None}
    unknown = sorted(set(given) - set(_AGGREGATOR_PARAMS[name]))
    if unknown:
        raise ConfigError(
            "aggregator",
            f"{name} takes no option {unknown[0]!r} (its options: {', '.join(_AGGREGATOR_PARAMS[name])})",
        )
    try:
        return AGGREGATORS[name](**given)
    except (TypeError, ValueError) as exc:
        raise ConfigError("aggregator", f"{name}: {exc}") from None


def strategy_options(name: str) -> tuple[str, ...]:
    """Every option ``build_strategy_from(name, ...)`` accepts.

    Raises:
        ConfigError: (key ``strategy``) unknown strategy.
    """
    if name not in STRATEGIES:
        raise ConfigError("strategy", f"unknown strategy {name!r} (known: {', '.join(STRATEGIES)})")
    return COMMON_OPTIONS + AGGREGATOR_OPTIONS + _STRATEGY_OPTIONS[name]


def strategy_role(name: str) -> UpdateRole:
    """What the built-in strategy ``name`` makes of the clients' updates (``Strategy.update_role``).

    Raises:
        ConfigError: (key ``strategy``) unknown strategy.
    """
    strategy_options(name)  # the unknown name's error
    role: UpdateRole = getattr(STRATEGIES[name], "update_role", UpdateRole.MODEL_AVERAGE)
    return role


def parse_block_prefixes(text: str) -> list[list[str]]:
    """``"conv1,conv2;fc"`` -> ``[["conv1", "conv2"], ["fc"]]``: blocks split by ``;``, prefixes by ``,``."""
    blocks = [[p.strip() for p in group.split(",") if p.strip()] for group in text.split(";")]
    if any(not group for group in blocks):
        raise ConfigError("block_prefixes", f"empty block in {text!r} (expected e.g. 'conv1,conv2;fc1;fc2')")
    return blocks


def _aggregator_from(options: Mapping[str, Any]) -> Aggregator | None:
    chosen = options.get("aggregator")
    params = {
        k[len("aggregator_") :]: v
        for k, v in options.items()
        if k.startswith("aggregator_") and v is not None
    }
    if isinstance(chosen, Aggregator):
        if params:
            raise ConfigError("aggregator", f"options {sorted(params)} given with an aggregator instance")
        return chosen
    name = "mean" if chosen is None else chosen
    if not isinstance(name, str):
        raise ConfigError("aggregator", f"expected a name or an Aggregator, got {chosen!r}")
    if name == "mean" and not params:
        return None  # the strategy's own weighted mean (FedAvg: exact model averaging)
    return build_aggregator(name, **params)


def build_strategy_from(name: str, *, policy: SelectionPolicy | None = None, **options: Any) -> Strategy:
    """The strategy ``name`` configured from ``options`` (see ``strategy_options(name)``).

    The common options (``fraction_fit``, ``min_fit_clients``, ``fraction_evaluate``, ``seed``,
    ``fit_config``) and ``policy`` (count, over-selection, selector) make the strategy's
    ``Sampling``. ``aggregator`` is a name (``--aggregator``; default ``mean``) with its parameters as
    ``aggregator_<param>`` options, or an ``Aggregator`` instance. ``block_prefixes`` may
    be a string as ``parse_block_prefixes`` reads it, or a list of lists. Call
    ``check_preconditions(num_clients=...)`` on the result once the number of clients is
    known, before any work starts.

    Raises:
        ConfigError: unknown strategy (key ``strategy``); an option that does not apply to
            it (the option's key); a bad aggregator (key ``aggregator``); a value out of
            range (key ``strategy``, the message names the option).
    """
    allowed = strategy_options(name)
    given = {k: v for k, v in options.items() if v is not None}
    if given.get("lora_aggregation") in ("factors", "ffa"):
        del given["lora_aggregation"]  # the plain mean of the state, which every strategy takes
    for key in given:
        if key not in allowed:
            specific = ", ".join(_STRATEGY_OPTIONS[name]) or "none"
            raise ConfigError(key, f"does not apply to strategy {name!r} (its own options: {specific})")
    kwargs = {k: v for k, v in given.items() if not k.startswith("aggregator") and k not in COMMON_OPTIONS}
    common = {k: v for k, v in given.items() if k in COMMON_OPTIONS}
    aggregator = _aggregator_from(given)
    if aggregator is not None:
        kwargs["aggregator"] = aggregator
    prefixes = kwargs.get("block_prefixes")
    if isinstance(prefixes, str):
        kwargs["block_prefixes"] = parse_block_prefixes(prefixes) if prefixes.strip() else None
    elif prefixes is not None and not all(
        isinstance(g, Sequence) and not isinstance(g, str) for g in prefixes
    ):
        raise ConfigError(
            "block_prefixes", "expected a string like 'conv1,conv2;fc' or a list of lists of prefixes"
        )
    try:
        return STRATEGIES[name](
            sampling=Sampling(**common, **({"policy": policy} if policy is not None else {})),  # type: ignore[arg-type]
            **kwargs,
        )
    except ConfigError:
        raise  # already names its key (e.g. DiLoCo's sync_delay_steps)
    except (TypeError, ValueError) as exc:
        raise ConfigError("strategy", f"{name}: {exc}") from None
