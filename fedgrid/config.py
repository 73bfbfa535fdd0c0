"""Run configuration: TOML files plus command-line overrides, checked before any work starts.

Every key of ``Config`` can be set in a TOML file (flat, top-level keys) and overridden on
the command line as ``--key-name VALUE``. Unknown keys, wrong types and out-of-range values
raise ``ConfigError`` naming the key. The keys that name a dataset, a model, a partition or
client heterogeneity are checked by ``fedgrid.simulation.tasks.check_config`` (the CLI and
``run_simulation`` call it before any work): their registries live in the simulation layer,
which this module, the server and the client never import.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

import tomllib

from fedgrid.capabilities import MAX_ACCELERATORS, check_capabilities, parse_size
from fedgrid.compression import parse_codec_spec
from fedgrid.constants import CHUNK_SIZE, HEARTBEAT_INTERVAL_S, MAX_NUM_EXAMPLES
from fedgrid.determinism import MAX_THREADS
from fedgrid.errors import ConfigError, InvalidUpdateError
from fedgrid.plugins import check_spec
from fedgrid.trackers import parse_trackers

__all__ = [
    "Config",
    "load_config",
    "config_keys",
    "key_type",
    "did_you_mean",
    "SELECTORS",
    "ENGINES",
    "STRATEGY_KEYS",
    "SIMULATION_ONLY_KEYS",
    "COORDINATOR_ONLY_KEYS",
    "CLIENT_ONLY_KEYS",
    "REGION_ONLY_KEYS",
]

SELECTORS = ("uniform", "region-balanced")
ENGINES = ("auto", "batched", "sequential")
#: Shown in ``--help``; the registry (``fedgrid.aggregation.registry``) is what validates.
_STRATEGY_NAMES = (
    "fedavg",
    "fedavgm",
    "fedadam",
    "fedyogi",
    "fedadagrad",
    "fedprox",
    "scaffold",
    "diloco",
    "streaming-diloco",
    "bcd",
)
_AGGREGATOR_NAMES = ("mean", "median", "trimmed-mean", "krum", "multi-krum", "norm-clip", "centered-clip")
#: Config keys handed to ``build_strategy_from`` as options (``None``: the strategy's default).
STRATEGY_KEYS = (
    "aggregator",
    "aggregator_f",
    "aggregator_m",
    "aggregator_bucket_size",
    "aggregator_resamplings",
    "aggregator_beta",
    "aggregator_bound",
    "aggregator_tau",
    "aggregator_iterations",
    "aggregator_weighted",
    "server_lr",
    "server_momentum",
    "server_nesterov",
    "server_beta1",
    "server_beta2",
    "server_tau",
    "proximal_mu",
    "total_clients",
    "outer_lr",
    "outer_momentum",
    "inner_steps",
    "inner_lr",
    "num_fragments",
    "num_blocks",
    "block_prefixes",
    "block_schedule",
)
#: Keys only ``fedgrid simulate`` uses: the simulated clients, their heterogeneity, the
#: engine that trains them, the progress line. ``fedgrid coordinator`` has no flags for them
#: (a shared TOML file may still hold them).
SIMULATION_ONLY_KEYS = frozenset(
    {
        "clients",
        "app",
        "engine",
        "batch_clients",
        "dropout_prob",
        "availability_trace",
        "speed",
        "examples_per_second",
        "regions",
        "progress",
        "hierarchy",
        "region_strategy",
        "lan_codec",
        "regional_rounds",
    }
)
#: Keys only a deployed coordinator uses: its network, TLS, durable state, enrollment and status server.
COORDINATOR_ONLY_KEYS = frozenset(
    {
        "listen",
        "max_workers",
        "min_clients",
        "state_dir",
        "heartbeat_interval_s",
        "initial_model",
        "ca",
        "cert",
        "key",
        "crl",
        "insecure",
        "enroll_listen",
        "enroll_dir",
        "http",
        "http_token_file",
        "require_device",
        "min_accelerators",
        "min_client_memory",
    }
)
#: Keys only ``fedgrid client`` uses (its ``--config`` file or its flags): what it reports at Join, and how
#: it trains across its node's devices (``fedgrid.client.parallel``).
CLIENT_ONLY_KEYS = frozenset(
    {
        "report_device",
        "report_accelerators",
        "report_memory",
        "nproc_per_node",
        "parallel",
        "comm_hook",
        "collective_timeout_s",
    }
)
#: Keys only ``fedgrid region`` uses: its upstream link and its name there (``fedgrid.region``).
REGION_ONLY_KEYS = frozenset(
    {"upstream", "name", "upstream_ca", "upstream_cert", "upstream_key", "upstream_server_name"}
)
log = logging.getLogger(__name__)
#: Strategies whose clients' inner optimizer takes ``inner_lr`` instead of ``lr``.
_INNER_LR_STRATEGIES = ("diloco", "streaming-diloco")
#: ``Config.lr``'s default: the only value of ``lr`` those strategies accept.
_LR_DEFAULT = 0.1

#: The table of a run directory's ``config.toml`` that records what the run ran on
#: (``fedgrid.determinism.environment``); informational when the file is loaded again.
ENVIRONMENT_TABLE = "environment"

_KINDS: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


def _key(help_text: str, default: Any) -> Any:
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class Config:
    """Every setting of a run. Field docs double as ``--help`` text."""

    rounds: int = _key("number of training rounds", 10)
    clients: int = _key("simulated clients (fedgrid simulate)", 10)
    min_clients: int = _key("a round starts only when this many clients are live", 2)
    fraction_fit: float = _key("share of live clients asked each round", 1.0)
    clients_per_round: int = _key("results a round waits for (0: fraction_fit of the live clients)", 0)
    over_selection: float = _key("ask this fraction more clients; close when clients_per_round reported", 0.0)
    selector: str = _key("which clients a round asks: uniform or region-balanced", "uniform")
    require_device: str = _key(
        "coordinator: only clients that report this device type (e.g. cuda) take tasks; empty: any", ""
    )
    min_accelerators: int = _key(
        "coordinator: only clients that report at least this many accelerators take tasks", 0
    )
    min_client_memory: str = _key(
        "coordinator: only clients that report at least this much memory (e.g. 16GiB: an accelerator's "
        "on a GPU client, the host's on a CPU client) take tasks",
        "0",
    )
    codec: str = _key(
        "uplink codec NAME[:PARAM][+zstd] (none, fp16, bf16, int8, qsgd:L, topk:F, randk:F, powersgd:R, sign)",
        "none",
    )
    region_codecs: str = _key("per-region uplink codecs, e.g. 'eu=bf16,us=topk:0.01' (others use codec)", "")
    downlink_codec: str = _key(
        "downlink codec: none, or a lossy codec with server-side error feedback", "none"
    )
    fraction_evaluate: float = _key(
        "share of live clients asked to evaluate each new model on their data (0: off)", 0.0
    )
    local_epochs: int = _key("local epochs per round", 2)
    lr: float = _key(
        "client learning rate (not diloco, streaming-diloco: their inner optimizer is AdamW, whose rate is inner_lr)",
        _LR_DEFAULT,
    )
    seed: int = _key("seed for model init, partitioning, sampling and shuffling", 0)
    dataset: str = _key(
        "built-in dataset: digits, fashion-mnist, shakespeare or synthetic (data, default model, server-side evaluation)",
        "digits",
    )
    data_dir: str = _key(
        "folder of the dataset's files (fashion-mnist: the four idx.gz files; shakespeare: see the README)",
        "",
    )
    model: str = _key(
        "a built-in model of the dataset (digits: mlp, logistic; fashion-mnist: mlp, cnn, logistic; shakespeare: lstm; synthetic: logistic), or MODULE:FACTORY returning your nn.Module (no server-side evaluation); empty: the dataset's default",
        "",
    )
    initial_model: str = _key(
        "fedgrid coordinator: a safetensors file holding the initial global model (instead of building --model)",
        "",
    )
    app: str = _key("MODULE:FACTORY(partition, num_partitions, seed) -> Client for simulated clients", "")
    partition: str = _key(
        "how the data is split among clients: iid, dirichlet:ALPHA, shards:N (N label-sorted shards per client) or natural; empty: the dataset's default (dirichlet:0.5; natural for shakespeare and synthetic)",
        "",
    )
    batch_size: int = _key("client batch size (built-in datasets)", 32)
    optimizer: str = _key("client optimizer (built-in datasets): sgd, adam or adamw", "sgd")
    momentum: float = _key("client SGD momentum (built-in datasets, optimizer sgd)", 0.9)
    weight_decay: float = _key("client weight decay (built-in datasets)", 0.0)
    threads: int = _key(
        "torch intra-op threads, set (torch.set_num_threads) before any work; 0: torch's default. Results are bit-identical only between runs with the same thread count (see the README's Determinism)",
        0,
    )
    report_device: str = _key(
        "fedgrid client: the device type Join reports instead of the detected one (empty: detected)", ""
    )
    report_accelerators: int | None = _key(
        "fedgrid client: the accelerator count Join reports instead of the detected one", None
    )
    report_memory: str = _key(
        "fedgrid client: the memory Join reports instead of the detected one, e.g. 16GiB (empty: detected)",
        "",
    )
    engine: str = _key(
        "simulation engine: auto (batched where it pays, else sequential), batched or sequential", "auto"
    )
    batch_clients: int = _key("clients the batched engine trains at once (0: as many as fit the device)", 0)
    dropout_prob: float = _key(
        "simulation: probability that a client is unavailable in a round (i.i.d. per client and round)", 0.0
    )
    availability_trace: str = _key(
        "simulation: JSON or CSV file of the rounds each client is available in (see the README)", ""
    )
    speed: str = _key(
        "simulation: relative client speed, a number or lognormal:SIGMA (one seeded draw per client)", "1.0"
    )
    examples_per_second: float = _key(
        "simulation: training examples per second of a client of speed 1 (simulated round times)", 1000.0
    )
    regions: str = _key("simulation: region labels and shares, e.g. 'us:0.5,eu:0.3,ap:0.2' (empty: none)", "")
    progress: bool = _key("fedgrid simulate: progress line per round on stderr", True)
    strategy: str = _key("aggregation strategy: " + ", ".join(_STRATEGY_NAMES), "fedavg")
    # Strategy and aggregator options: None (absent) keeps the strategy's own default; an
    # option set for a strategy it does not apply to is an error (see aggregation/registry.py).
    aggregator: str | None = _key(
        "robust aggregation rule: " + ", ".join(_AGGREGATOR_NAMES) + " (default mean)", None
    )
    aggregator_f: int | None = _key("krum / multi-krum: Byzantine clients tolerated", None)
    aggregator_m: int | None = _key("multi-krum: updates averaged (default n - f)", None)
    aggregator_bucket_size: int | None = _key(
        "krum: updates averaged per bucket before Krum picks (default: the most that n > 2 s f + 2 allows; 1: plain Krum)",
        None,
    )
    aggregator_resamplings: int | None = _key(
        "krum: bucket shuffles whose picks are averaged (default 10)", None
    )
    aggregator_beta: float | None = _key("trimmed-mean: share trimmed at each end", None)
    aggregator_bound: float | None = _key(
        "norm-clip: largest L2 norm an update keeps (default: the median norm of the round's updates)", None
    )
    aggregator_tau: float | None = _key("centered-clip: clipping radius", None)
    aggregator_iterations: int | None = _key("centered-clip: iterations", None)
    aggregator_weighted: bool | None = _key("weight updates by examples in the aggregator", None)
    server_lr: float | None = _key(
        "server learning rate (fedavgm, fedadam, fedyogi, fedadagrad, scaffold)", None
    )
    server_momentum: float | None = _key("fedavgm: server momentum", None)
    server_nesterov: bool | None = _key("fedavgm: Nesterov momentum", None)
    server_beta1: float | None = _key("fedadam, fedyogi, fedadagrad: first-moment decay", None)
    server_beta2: float | None = _key("fedadam, fedyogi: second-moment decay", None)
    server_tau: float | None = _key("fedadam, fedyogi, fedadagrad: adaptivity (epsilon)", None)
    proximal_mu: float | None = _key("fedprox: proximal coefficient mu", None)
    total_clients: int | None = _key("scaffold: N, all clients (default: the live clients)", None)
    outer_lr: float | None = _key("diloco, streaming-diloco: outer learning rate (default 0.7)", None)
    outer_momentum: float | None = _key(
        "diloco, streaming-diloco: outer Nesterov momentum (default 0.9)", None
    )
    inner_steps: int | None = _key(
        "diloco, streaming-diloco: H, inner optimizer steps per round (default 50)", None
    )
    inner_lr: float | None = _key(
        "diloco, streaming-diloco: learning rate of the inner optimizer, AdamW (default 1e-3; lr does not apply to them)",
        None,
    )
    num_fragments: int | None = _key("streaming-diloco: F, fragments synced in rotation", None)
    num_blocks: int | None = _key("bcd: B, blocks of the default partition", None)
    block_prefixes: str | None = _key("bcd: blocks as name prefixes, e.g. 'conv1,conv2;fc'", None)
    block_schedule: str | None = _key(
        "bcd: per-round (default: every client trains block (round - 1) mod B), cyclic, random or capacity",
        None,
    )
    max_num_examples: int = _key(
        "largest num_examples a client may report at join or claim for an update; an update may also claim no more than its client reported at join",
        MAX_NUM_EXAMPLES,
    )
    max_update_norm: float = _key(
        "refuse an update whose L2 distance from the round's global model (floating tensors) is over this (0: no bound)",
        0.0,
    )
    round_timeout_s: float = _key("each round closes by this deadline", 300.0)
    join_timeout_s: float = _key("longest wait for min_clients before a round", 600.0)
    heartbeat_interval_s: float = _key("client heartbeat interval", HEARTBEAT_INTERVAL_S)
    chunk_size: int = _key("payload bytes per wire chunk", CHUNK_SIZE)
    listen: str = _key("coordinator address HOST:PORT (port 0 picks a free one)", "0.0.0.0:50051")
    max_workers: int = _key("coordinator RPC threads (one per long poll)", 256)
    ca: str = _key(
        "mutual TLS: PEM file of the CA certificate(s) that sign the peers' certificates (see `fedgrid certs`)",
        "",
    )
    cert: str = _key("mutual TLS: PEM file of this side's certificate", "")
    key: str = _key("mutual TLS: PEM file of this side's private key (mode 0600)", "")
    crl: str = _key(
        "coordinator, mutual TLS: PEM revocation list, re-read when it changes (fedgrid certs keeps DIR/crl.pem)",
        "",
    )
    insecure: bool = _key(
        "coordinator: serve plaintext on a non-loopback address (anyone who reaches the port can join)", False
    )
    enroll_listen: str = _key(
        "coordinator: HOST:PORT of the enrollment service, where devices trade a one-time token "
        "(`fedgrid certs token`) for a client certificate; TLS with the coordinator's cert, needs ca/cert/key "
        "and enroll_dir (port 0 picks a free one, written to RUN_DIR/enroll_address); empty: off",
        "",
    )
    enroll_dir: str = _key(
        "coordinator, with enroll_listen: the certificate directory whose CA signs enrolled clients "
        "(ca.pem, ca.key, tokens.json of `fedgrid certs init`)",
        "",
    )
    tracker: str = _key(
        "experiment trackers fed every round's metrics, comma-separated: tensorboard (RUN_DIR/tensorboard/), "
        "mlflow (where MLFLOW_TRACKING_URI points); empty: none (metrics.jsonl is always written)",
        "",
    )
    http: str = _key(
        "coordinator: HOST:PORT of a read-only HTTP server with /metrics (Prometheus), /api/status and a status "
        "page (port 0 picks a free one, written to RUN_DIR/http_address; needs the monitor extra); a non-loopback "
        "host needs http_token_file; empty: off",
        "",
    )
    http_token_file: str = _key(
        "coordinator, with http: a file holding the bearer token the HTTP server asks for "
        "(Authorization: Bearer TOKEN; required on a non-loopback host)",
        "",
    )
    nproc_per_node: int = _key(
        "fedgrid client: local processes (ranks) that train together, one per GPU (gloo on CPU); "
        "this process is rank 0 and starts the others (or torchrun does)",
        1,
    )
    parallel: str = _key(
        "fedgrid client, with nproc_per_node: dp (DDP), fsdp (FSDP2) or hsdp:RxS (FSDP2 on R replicas, each "
        "sharded S ways)",
        "dp",
    )
    comm_hook: str = _key(
        "fedgrid client, with nproc_per_node: gradient compression between its ranks: none, fp16, bf16 or "
        "powersgd[:RANK] (DDP only)",
        "none",
    )
    collective_timeout_s: float = _key(
        "fedgrid client, with nproc_per_node: timeout of every collective between its ranks; a "
        "rank that hangs fails the round after this long",
        300.0,
    )
    upstream: str = _key("fedgrid region: HOST:PORT of the global coordinator it joins as one client", "")
    name: str = _key(
        "fedgrid region: its name ([A-Za-z0-9._-], at most 64): its client name upstream and its region label",
        "",
    )
    regional_rounds: int = _key(
        "fedgrid region, and simulate with hierarchy: H, regional rounds per global round (hierarchical local SGD)",
        1,
    )
    hierarchy: bool = _key(
        "simulation: the regions (the regions key) are tiers, as fedgrid region runs them: each aggregates its clients "
        "regional_rounds rounds with region_strategy and the lan_codec uplink, then sends its model up (codec, "
        "region_codecs: the WAN uplink) to the global strategy",
        False,
    )
    region_strategy: str = _key(
        "simulation with hierarchy: the regions' own strategy, with its defaults (the global tier's is strategy)",
        "fedavg",
    )
    lan_codec: str = _key(
        "simulation with hierarchy: the uplink codec from a region's clients to it (a region's codec)", "none"
    )
    upstream_ca: str = _key(
        "fedgrid region, mutual TLS upstream: PEM CA bundle that signs the global coordinator's certificate",
        "",
    )
    upstream_cert: str = _key(
        "fedgrid region, mutual TLS upstream: the region's client certificate (its identity is its name upstream)",
        "",
    )
    upstream_key: str = _key("fedgrid region, mutual TLS upstream: the region's client key", "")
    upstream_server_name: str = _key(
        "fedgrid region: the name the global coordinator's certificate holds, when not the host of upstream",
        "",
    )
    out: str = _key("run directory", "")
    state_dir: str = _key("durable coordinator state directory", "")

    def __post_init__(self) -> None:
        # The checks run in this order: of several wrong keys, the first one found is reported.
        self._check_ranges()
        self._check_codecs_and_strategy()
        self._check_endpoints()
        for key in ("momentum", "weight_decay", "max_update_norm"):
            if not 0.0 <= getattr(self, key) < float("inf"):
                raise ConfigError(key, f"must be a finite number at least 0, got {getattr(self, key)}")
        parse_trackers(self.tracker)  # known names, packages installed: before any work
        if self.engine not in ENGINES:
            raise ConfigError("engine", f"unknown engine {self.engine!r} (known: {', '.join(ENGINES)})")
        if not 0 <= self.threads <= MAX_THREADS:
            raise ConfigError(
                "threads", f"must be in 0..{MAX_THREADS} (0: torch's default), got {self.threads}"
            )
        if self.batch_clients < 0:
            raise ConfigError("batch_clients", f"must be at least 0, got {self.batch_clients}")
        self._check_capability_keys()
        # The data, model and heterogeneity keys need the simulation layer's registries:
        # ``fedgrid.simulation.tasks.check_config`` checks them (the CLI and run_simulation
        # call it before any work), so this module and the server never import that layer.

    def _check_ranges(self) -> None:
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
        )
        for key in positive_ints:
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if self.regional_rounds < 1:
            raise ConfigError("regional_rounds", f"must be at least 1, got {self.regional_rounds}")
        if self.nproc_per_node < 1:
            raise ConfigError("nproc_per_node", f"must be at least 1, got {self.nproc_per_node}")
        for key in (
            "collective_timeout_s",
            "lr",
            "round_timeout_s",
            "join_timeout_s",
            "heartbeat_interval_s",
            "examples_per_second",
        ):
            if not getattr(self, key) > 0:
                raise ConfigError(key, f"must be positive, got {getattr(self, key)}")
        if not 0.0 < self.fraction_fit <= 1.0:
            raise ConfigError("fraction_fit", f"must be in (0, 1], got {self.fraction_fit}")
        if self.clients_per_round < 0:
            raise ConfigError("clients_per_round", f"must be at least 0, got {self.clients_per_round}")
        if not 0.0 <= self.over_selection <= 10.0:
            raise ConfigError("over_selection", f"must be in [0, 10], got {self.over_selection}")
        if self.selector not in SELECTORS:
            raise ConfigError(
                "selector", f"unknown selector {self.selector!r} (known: {', '.join(SELECTORS)})"
            )

    def _check_codecs_and_strategy(self) -> None:
        """The codec specs, the evaluation fraction, the app, the chunk size, and the strategy
        with its options (built once to check them)."""
        from fedgrid.compression.feedback import ErrorFeedback
        from fedgrid.compression.registry import parse_region_codecs

        for key in ("codec", "downlink_codec"):
            spec = getattr(self, key)
            codec = parse_codec_spec(spec, key=key)
            if not codec.lossless:
                ErrorFeedback(spec if key == "codec" else codec)  # lossy codecs must suit error feedback
        for spec in parse_region_codecs(self.region_codecs).values():
            parse_codec_spec(spec, key="region_codecs")
        if not 0.0 <= self.fraction_evaluate <= 1.0:
            raise ConfigError("fraction_evaluate", f"must be in [0, 1], got {self.fraction_evaluate}")
        if self.app:
            check_spec(self.app, key="app")
        if self.chunk_size > 3 * 1024 * 1024:
            raise ConfigError(
                "chunk_size", f"must be at most 3 MiB to stay under gRPC's 4 MB limit, got {self.chunk_size}"
            )
        from fedgrid.aggregation.registry import build_strategy_from

        # Building the strategy checks its name, which options apply to it and their
        # ranges, and the aggregator; a model-dependent check (block partition) follows at
        # initialize, the client-count check (Krum's n > 2f + 2) once that count is known.
        build_strategy_from(self.strategy, seed=self.seed, **self.strategy_options())
        if self.strategy in _INNER_LR_STRATEGIES and self.lr != _LR_DEFAULT:
            # The task's lr would be replaced by inner_lr: an lr given here would do nothing.
            raise ConfigError(
                "lr",
                f"does not apply to strategy {self.strategy!r}: its inner optimizer (AdamW) "
                f"takes inner_lr (default 1e-3), got lr={self.lr}",
            )

    def _check_endpoints(self) -> None:
        """Mutual TLS files (all or none), the listen, enrollment and HTTP addresses, and the
        keys that only go with one of them."""
        tls_given = [k for k in ("ca", "cert", "key") if getattr(self, k)]
        if tls_given and len(tls_given) != 3:
            missing = [k for k in ("ca", "cert", "key") if k not in tls_given]
            raise ConfigError(
                missing[0], f"ca, cert and key go together (mutual TLS); missing {', '.join(missing)}"
            )
        if self.crl and not tls_given:
            raise ConfigError("crl", "a revocation list needs ca, cert and key (mutual TLS)")
        if tls_given and self.insecure:
            raise ConfigError("insecure", "insecure (plaintext) contradicts ca/cert/key (mutual TLS)")
        for key in [k for k in ("listen", "enroll_listen", "http") if k == "listen" or getattr(self, k)]:
            host, sep, port = getattr(self, key).rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) > 65535:
                raise ConfigError(key, f"expected HOST:PORT, got {getattr(self, key)!r}")
        if self.http_token_file and not self.http:
            raise ConfigError(
                "http_token_file", "is used only with http (the address of the HTTP status server)"
            )
        if self.enroll_listen and not self.enroll_dir:
            raise ConfigError(
                "enroll_dir",
                "enroll_listen needs enroll_dir, the certificate directory whose CA signs enrolled clients",
            )
        if self.enroll_dir and not self.enroll_listen:
            raise ConfigError(
                "enroll_dir", "is used only with enroll_listen (the address of the enrollment service)"
            )
        if self.enroll_listen and not tls_given:
            raise ConfigError(
                "enroll_listen",
                "enrollment needs ca, cert and key: it serves TLS with the coordinator's certificate, "
                "never plaintext (a listener on the path would read tokens and could hand out certificates)",
            )

    def _check_capability_keys(self) -> None:
        """The capability requirements (``require_device`` ...) and what a client states (``report_*``)."""
        for key in ("require_device", "report_device"):
            if getattr(self, key):
                try:
                    check_capabilities(getattr(self, key), 0, 0)
                except InvalidUpdateError as exc:
                    raise ConfigError(key, str(exc).removeprefix("device: ")) from None
        for key in ("min_accelerators", "report_accelerators"):
            value = getattr(self, key)
            if value is not None and not 0 <= value <= MAX_ACCELERATORS:
                raise ConfigError(key, f"must be in 0..{MAX_ACCELERATORS}, got {value}")
        for key in ("min_client_memory", "report_memory"):
            if key == "min_client_memory" or self.report_memory:
                try:
                    parse_size(getattr(self, key), what=key)
                except ValueError as exc:
                    raise ConfigError(key, str(exc).removeprefix(f"{key}: ")) from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def strategy_options(self) -> dict[str, Any]:
        """The strategy and aggregator options that are set (``None`` ones left out)."""
        return {key: getattr(self, key) for key in STRATEGY_KEYS if getattr(self, key) is not None}


def config_keys() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in fields(Config)}


def key_type(f: dataclasses.Field) -> tuple[type, bool]:
    """The scalar type of a config field and whether it is optional (``T | None``)."""
    text = str(f.type).replace(" ", "")
    optional = text.endswith("|None")
    return _KINDS[text.removesuffix("|None")], optional


_KEYS_LISTED = " (see `fedgrid simulate --help` or `fedgrid coordinator --help` for the keys)"


def did_you_mean(word: str, known: Iterable[str], *, otherwise: str = _KEYS_LISTED) -> str:
    """``" (did you mean 'x'?)"`` for the known words closest to ``word`` (``difflib``), else
    ``otherwise`` (a pointer to where they are listed): never the whole list, which buries the answer."""
    close = difflib.get_close_matches(word, list(known), n=3, cutoff=0.6)
    if not close:
        return otherwise
    return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"


def _coerce(key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str:
        if isinstance(value, str):
            return value
    raise ConfigError(key, f"expected {kind.__name__}, got {value!r}")


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Builds a ``Config`` from defaults, an optional TOML file, then ``overrides``.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or bad value (names the key).
    """
    keys = config_keys()
    # An optional key (``T | None``) takes a T; a TOML file cannot hold None, so None means absent.
    types = {name: key_type(f)[0] for name, f in keys.items()}
    values: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError("config", f"file {str(path)!r} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None
        recorded = data.pop(ENVIRONMENT_TABLE, None)
        if isinstance(recorded, dict):
            import torch

            if recorded.get("torch") not in (None, torch.__version__):
                log.warning(
                    "%s was written by torch %s, this is torch %s: results may differ in the last bits",
                    path,
                    recorded.get("torch"),
                    torch.__version__,
                )
        elif recorded is not None:
            raise ConfigError(ENVIRONMENT_TABLE, f"in {path} must be a table, got {recorded!r}")
        for key, value in data.items():
            if key not in keys:
                raise ConfigError(key, f"unknown key in {path}{did_you_mean(key, keys)}")
            values[key] = _coerce(key, value, types[key])
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in keys:
            raise ConfigError(key, f"unknown key{did_you_mean(key, keys)}")
        values[key] = _coerce(key, value, types[key])
    return Config(**values)
