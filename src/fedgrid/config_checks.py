"""The checks a ``Config`` runs when it is built: ranges, codecs and the strategy's options, network
endpoints and TLS files, capability requirements. Each raises ``ConfigError`` naming the key; of
several wrong keys, the first one found is reported.
"""

from __future__ import annotations

from typing import Any, Protocol

from fedgrid.capabilities import MAX_ACCELERATORS, check_capabilities, parse_size
from fedgrid.config_compression import RunCodecs
from fedgrid.config_groups import ENGINES, INNER_LR_STRATEGIES, LR_DEFAULT, PRECISIONS, SELECTORS
from fedgrid.config_llm import check_llm_keys
from fedgrid.config_privacy import PrivateRun, check_privacy
from fedgrid.config_secagg import check_secagg_keys
from fedgrid.determinism import MAX_THREADS
from fedgrid.errors import ConfigError, InvalidUpdateError
from fedgrid.plugins import check_spec, is_custom_strategy
from fedgrid.trackers import parse_trackers

__all__ = ["validate", "CheckedRun", "QUORUM_STRATEGIES"]

#: The strategies that can merge a late result into a later round (``min_quorum``): each
#: updates the whole model from the results' differences, or (``streaming-diloco``) a late
#: fragment into its own fragment.
QUORUM_STRATEGIES = (
    "fedavg",
    "fedavgm",
    "fedadam",
    "fedyogi",
    "fedadagrad",
    "fedprox",
    "diloco",
    "streaming-diloco",
)


class CheckedRun(PrivateRun, Protocol):
    """What ``validate`` reads of a run's configuration: a ``fedgrid.config.Config`` is one (the
    checks run inside it, so they take it by what they read rather than by its class)."""

    @property
    def app(self) -> str: ...

    @property
    def batch_clients(self) -> int: ...

    @property
    def chunk_size(self) -> int: ...

    @property
    def clients_per_round(self) -> int: ...

    @property
    def crl(self) -> str: ...

    @property
    def engine(self) -> str: ...

    @property
    def enroll_dir(self) -> str: ...

    @property
    def enroll_listen(self) -> str: ...

    @property
    def error_feedback(self) -> str: ...

    @property
    def fraction_evaluate(self) -> float: ...

    @property
    def fraction_fit(self) -> float: ...

    @property
    def grad_accum(self) -> int: ...

    @property
    def http(self) -> str: ...

    @property
    def http_linger_s(self) -> float: ...

    @property
    def http_token_file(self) -> str: ...

    @property
    def insecure(self) -> bool: ...

    @property
    def lora_aggregation(self) -> str | None: ...

    @property
    def lr(self) -> float: ...

    @property
    def max_weight_share(self) -> float: ...

    @property
    def min_update_cosine(self) -> float: ...

    @property
    def model(self) -> str: ...

    @property
    def nproc_per_node(self) -> int: ...

    @property
    def over_selection(self) -> float: ...

    @property
    def peft(self) -> str: ...

    @property
    def peft_rank(self) -> str: ...

    @property
    def precision(self) -> str: ...

    @property
    def regional_rounds(self) -> int: ...

    @property
    def report_memory(self) -> str: ...

    @property
    def seed(self) -> int: ...

    @property
    def selector(self) -> str: ...

    @property
    def state_dir(self) -> str: ...

    @property
    def threads(self) -> int: ...

    @property
    def tracker(self) -> str: ...

    @property
    def codecs(self) -> RunCodecs: ...

    def strategy_options(self) -> dict[str, Any]: ...


def validate(config: CheckedRun) -> None:
    """Checks every key of ``config`` (``Config.__post_init__`` calls this).

    Raises:
        ConfigError: the first key found out of range, of an unknown value, or in a wrong combination.
    """
    # The checks run in this order: of several wrong keys, the first one found is reported.
    _check_ranges(config)
    _check_codecs_and_strategy(config)
    _check_endpoints(config)
    for key in ("momentum", "weight_decay", "max_update_norm"):
        if not 0.0 <= getattr(config, key) < float("inf"):
            raise ConfigError(key, f"must be a finite number at least 0, got {getattr(config, key)}")
    for key in ("max_update_ratio", "max_weight_ratio", "max_deviation_ratio"):
        value = getattr(config, key)
        if not (value == 0 or 1.0 <= value < float("inf")):
            raise ConfigError(key, f"must be 0 (off) or a finite number at least 1, got {value}")
    if not -1.0 <= config.min_update_cosine <= 1.0:
        raise ConfigError(
            "min_update_cosine", f"must be a cosine in [-1, 1] (-1: off), got {config.min_update_cosine}"
        )
    if not 0.0 <= config.max_weight_share <= 1.0:
        raise ConfigError(
            "max_weight_share", f"must be 0 (off) or a share in (0, 1], got {config.max_weight_share}"
        )
    check_secagg_keys(config)
    parse_trackers(config.tracker)  # known names, packages installed: before any work
    if config.engine not in ENGINES:
        raise ConfigError("engine", f"unknown engine {config.engine!r} (known: {', '.join(ENGINES)})")
    if config.precision not in PRECISIONS:
        raise ConfigError(
            "precision", f"unknown precision {config.precision!r} (known: {', '.join(PRECISIONS)})"
        )
    if not 0 <= config.threads <= MAX_THREADS:
        raise ConfigError(
            "threads", f"must be in 0..{MAX_THREADS} (0: torch's default), got {config.threads}"
        )
    if config.batch_clients < 0:
        raise ConfigError("batch_clients", f"must be at least 0, got {config.batch_clients}")
    _check_capability_keys(config)
    check_privacy(config)
    check_llm_keys(config.peft, config.lora_aggregation, config.aggregator, config.model, config.peft_rank)
    if config.grad_accum < 1:
        raise ConfigError("grad_accum", f"must be at least 1, got {config.grad_accum}")
    # The data, model and heterogeneity keys need the simulation layer's registries:
    # ``fedgrid.simulation.tasks.check_config`` checks them (the CLI and run_simulation
    # call it before any work), so the config modules and the server never import that layer.


def _check_ranges(config: CheckedRun) -> None:
    """Counts, timeouts and fractions in their ranges, and a known client selector."""
    positive_ints = (
        "rounds",
        "clients",
        "min_clients",
        "local_epochs",
        "chunk_size",
        "max_workers",
        "batch_size",
        "max_num_examples",
        "eval_every",
        "eval_batches",
    )
    for key in positive_ints:
        if getattr(config, key) < 1:
            raise ConfigError(key, f"must be at least 1, got {getattr(config, key)}")
    if config.regional_rounds < 1:
        raise ConfigError("regional_rounds", f"must be at least 1, got {config.regional_rounds}")
    if config.nproc_per_node < 1:
        raise ConfigError("nproc_per_node", f"must be at least 1, got {config.nproc_per_node}")
    for key in (
        "collective_timeout_s",
        "lr",
        "round_timeout_s",
        "join_timeout_s",
        "heartbeat_interval_s",
        "examples_per_second",
    ):
        if not getattr(config, key) > 0:
            raise ConfigError(key, f"must be positive, got {getattr(config, key)}")
    if not 0.0 < config.fraction_fit <= 1.0:
        raise ConfigError("fraction_fit", f"must be in (0, 1], got {config.fraction_fit}")
    if config.clients_per_round < 0:
        raise ConfigError("clients_per_round", f"must be at least 0, got {config.clients_per_round}")
    if not 0.0 <= config.over_selection <= 10.0:
        raise ConfigError("over_selection", f"must be in [0, 10], got {config.over_selection}")
    _check_quorum(config)
    if config.selector not in SELECTORS:
        raise ConfigError("selector", f"unknown selector {config.selector!r} (known: {', '.join(SELECTORS)})")


def _check_quorum(config: CheckedRun) -> None:
    """The semi-asynchronous round keys: in range, and a quorum a round can reach.

    A quorum larger than a fixed selection (``clients_per_round``) is refused here; one
    larger than a selection of ``fraction_fit`` of the live clients is refused by the engine
    at the first round, when that selection is known (``RoundEngine``)."""
    for key in ("min_quorum", "max_staleness"):
        if getattr(config, key) < 0:
            raise ConfigError(key, f"must be at least 0, got {getattr(config, key)}")
    for key in ("grace_s", "staleness_exponent"):
        if not 0.0 <= getattr(config, key) < float("inf"):
            raise ConfigError(key, f"must be a finite number at least 0, got {getattr(config, key)}")
    if not config.min_quorum:
        return
    if 0 < config.clients_per_round < config.min_quorum:
        raise ConfigError(
            "min_quorum",
            f"a quorum of {config.min_quorum} is larger than the round's selection of "
            f"{config.clients_per_round} clients (clients_per_round): lower min_quorum or raise clients_per_round",
        )
    if config.over_selection:
        raise ConfigError(
            "min_quorum",
            "does not go with over_selection (a round closes at its quorum; over-selected "
            "clients would be cancelled): set one of them",
        )
    if is_custom_strategy(config.strategy):
        raise ConfigError(
            "min_quorum",
            f"takes a built-in strategy ({', '.join(QUORUM_STRATEGIES)}): a late result reaches the strategy as "
            f"the current model plus its difference, which {config.strategy!r} was not written for",
        )
    if config.strategy not in QUORUM_STRATEGIES:
        raise ConfigError(
            "min_quorum",
            f"strategy {config.strategy!r} cannot merge a late result into a later round "
            "(bcd's blocks are chosen per round and client, scaffold's control variates belong to their "
            f"round): semi-asynchronous rounds take {', '.join(QUORUM_STRATEGIES)}",
        )


def _check_codecs_and_strategy(config: CheckedRun) -> None:
    """The codec specs, the evaluation fraction, the app, the chunk size, and the strategy
    with its options (built once to check them)."""
    from fedgrid.compression.feedback import ErrorFeedback, FeedbackRule
    from fedgrid.config_compression import check_compression

    check_compression(config)
    codecs = config.codecs  # every codec key parses (ConfigError naming the key)
    for key, spec in (("codec", codecs.uplink), ("downlink_codec", codecs.downlink)):
        if not spec.lossless:
            # Lossy codecs must suit the error feedback: the uplink's rule, the downlink's classic.
            rule = FeedbackRule.parse(config.error_feedback) if key == "codec" else None
            ErrorFeedback(spec, rule)
    if not 0.0 <= config.fraction_evaluate <= 1.0:
        raise ConfigError("fraction_evaluate", f"must be in [0, 1], got {config.fraction_evaluate}")
    if config.app:
        check_spec(config.app, key="app")
    if config.chunk_size > 3 * 1024 * 1024:
        raise ConfigError(
            "chunk_size", f"must be at most 3 MiB to stay under gRPC's 4 MB limit, got {config.chunk_size}"
        )
    from fedgrid.aggregation.by_name import build_strategy_from

    if is_custom_strategy(config.strategy):
        # Your own MODULE:CLASS, checked in form here, as --app is; imported and built (its options
        # checked against its signature) by fedgrid.server.strategies.build_strategy before any work.
        check_spec(config.strategy, key="strategy")
        return
    # Building the strategy checks its name, which options apply to it and their
    # ranges, and the aggregator; a model-dependent check (block partition) follows at
    # initialize, the client-count check (Krum's n > 2f + 2) once that count is known.
    build_strategy_from(config.strategy, seed=config.seed, **config.strategy_options())
    if config.strategy in INNER_LR_STRATEGIES and config.lr != LR_DEFAULT:
        # The task's lr would be replaced by inner_lr: an lr given here would do nothing.
        raise ConfigError(
            "lr",
            f"does not apply to strategy {config.strategy!r}: its inner optimizer (AdamW) "
            f"takes inner_lr (default 1e-3), got lr={config.lr}",
        )


def _check_endpoints(config: CheckedRun) -> None:
    """Mutual TLS files (all or none), the listen, enrollment and HTTP addresses, and the
    keys that only go with one of them."""
    tls_given = [k for k in ("ca", "cert", "key") if getattr(config, k)]
    if tls_given and len(tls_given) != 3:
        missing = [k for k in ("ca", "cert", "key") if k not in tls_given]
        raise ConfigError(
            missing[0], f"ca, cert and key go together (mutual TLS); missing {', '.join(missing)}"
        )
    if config.crl and not tls_given:
        raise ConfigError("crl", "a revocation list needs ca, cert and key (mutual TLS)")
    if tls_given and config.insecure:
        raise ConfigError("insecure", "insecure (plaintext) contradicts ca/cert/key (mutual TLS)")
    for key in ("fresh", "state_key"):
        if getattr(config, key) and not config.state_dir:
            raise ConfigError(key, "goes with state_dir (durable coordinator state); none given")
    for key in [k for k in ("listen", "enroll_listen", "http") if k == "listen" or getattr(config, k)]:
        host, sep, port = getattr(config, key).rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(key, f"expected HOST:PORT, got {getattr(config, key)!r}")
    if config.http_token_file and not config.http:
        raise ConfigError("http_token_file", "is used only with http (the address of the HTTP status server)")
    if not 0.0 <= config.http_linger_s < float("inf"):
        raise ConfigError(
            "http_linger_s", f"must be a finite number of seconds at least 0, got {config.http_linger_s}"
        )
    if config.enroll_listen and not config.enroll_dir:
        raise ConfigError(
            "enroll_dir",
            "enroll_listen needs enroll_dir, the certificate directory whose CA signs enrolled clients",
        )
    if config.enroll_dir and not config.enroll_listen:
        raise ConfigError(
            "enroll_dir", "is used only with enroll_listen (the address of the enrollment service)"
        )
    if config.enroll_listen and not tls_given:
        raise ConfigError(
            "enroll_listen",
            "enrollment needs ca, cert and key: it serves TLS with the coordinator's certificate, "
            "never plaintext (a listener on the path would read tokens and could hand out certificates)",
        )


def _check_capability_keys(config: CheckedRun) -> None:
    """The capability requirements (``require_device`` ...) and what a client states (``report_*``)."""
    for key in ("require_device", "report_device"):
        if getattr(config, key):
            try:
                check_capabilities(getattr(config, key), 0, 0)
            except InvalidUpdateError as exc:
                raise ConfigError(key, str(exc).removeprefix("device: ")) from None
    for key in ("min_accelerators", "report_accelerators"):
        value = getattr(config, key)
        if value is not None and not 0 <= value <= MAX_ACCELERATORS:
            raise ConfigError(key, f"must be in 0..{MAX_ACCELERATORS}, got {value}")
    for key in ("min_client_memory", "report_memory"):
        if key == "min_client_memory" or config.report_memory:
            try:
                parse_size(getattr(config, key), what=key)
            except ValueError as exc:
                raise ConfigError(key, str(exc).removeprefix(f"{key}: ")) from None
