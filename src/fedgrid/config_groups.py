"""The key groups of the run configuration: the known values of its closed-choice keys, the keys
handed to the strategy, and the keys that only one command (simulate, coordinator, client, region)
uses. ``fedgrid.config`` re-exports them; the CLI reads them to decide which flags each command has.
"""

from __future__ import annotations

__all__ = [
    "SELECTORS",
    "ENGINES",
    "PRECISIONS",
    "STRATEGY_NAMES",
    "AGGREGATOR_NAMES",
    "STRATEGY_KEYS",
    "SIMULATION_ONLY_KEYS",
    "COORDINATOR_ONLY_KEYS",
    "CLIENT_ONLY_KEYS",
    "CLIENT_SIDE_KEYS",
    "REGION_ONLY_KEYS",
    "PRIVACY_KEYS",
    "INNER_LR_STRATEGIES",
    "LR_DEFAULT",
]

SELECTORS = ("uniform", "region-balanced")
ENGINES = ("auto", "batched", "sequential")
#: Values of ``precision`` (``fedgrid.client.precision``).
PRECISIONS = ("auto", "bf16", "fp32")
#: Shown in ``--help``; ``fedgrid.aggregation.by_name`` is what validates.
STRATEGY_NAMES = (
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
AGGREGATOR_NAMES = (
    "mean",
    "median",
    "trimmed-mean",
    "krum",
    "multi-krum",
    "norm-clip",
    "centered-clip",
    "sender-mean",
)
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
    "sync_delay_steps",
    "merge_alpha",
    "inner_time_s",
    "num_blocks",
    "block_prefixes",
    "block_schedule",
    "lora_aggregation",
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
        "replay",
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
        "fresh",
        "state_key",
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
        "http_linger_s",
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
#: Keys of the clients that ``fedgrid client`` and ``fedgrid simulate`` take and a coordinator or
#: region does not: a client's own LoRA rank (a coordinator's bound is its ``peft``'s r), and
#: ``quiet`` (no progress inside a task: ``fedgrid.client.progress``).
CLIENT_SIDE_KEYS = frozenset({"peft_rank", "quiet", "text_column", "label_column"})
#: Keys only ``fedgrid region`` uses: its upstream link and its name there (``fedgrid.region``).
REGION_ONLY_KEYS = frozenset(
    {"upstream", "name", "upstream_ca", "upstream_cert", "upstream_key", "upstream_server_name"}
)
#: Keys of semi-asynchronous rounds (``min_quorum``): a global coordinator's; ``fedgrid region``'s own
#: rounds are synchronous (a region is one learner upstream), so it takes none of them.
QUORUM_KEYS = frozenset({"min_quorum", "grace_s", "max_staleness", "staleness_exponent"})
#: Keys of differential privacy (``fedgrid.config_privacy``): a global coordinator's and a simulation's;
#: ``fedgrid region`` takes none of them yet (docs/privacy.rst).
PRIVACY_KEYS = frozenset(
    {"dp_noise_multiplier", "dp_clip", "dp_epsilon", "dp_delta", "dp_noise_key", "dp_accountant"}
)
#: Strategies whose clients' inner optimizer takes ``inner_lr`` instead of ``lr``.
INNER_LR_STRATEGIES = ("diloco", "streaming-diloco")
#: ``Config.lr``'s default: the only value of ``lr`` those strategies accept.
LR_DEFAULT = 0.1
