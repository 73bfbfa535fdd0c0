"""Run configuration: TOML files plus command-line overrides, checked before any work starts.

Every key of ``Config`` can be set in a TOML file (flat, top-level keys) and overridden on
the command line as ``--key-name VALUE``. Unknown keys, wrong types and out-of-range values
raise ``ConfigError`` naming the key. Types are checked one way for files and Python
overrides (an integer key takes only integers: neither ``"5"`` nor ``5.0``); only flags'
text is parsed (``parse_flag``). The keys that name a dataset, a model, a partition or
client heterogeneity are checked by ``fedgrid.simulation.tasks.check_config`` (the CLI and
``run_simulation`` call it before any work): their registries live in the simulation layer,
which this module, the server and the client never import.

The checks a ``Config`` runs live in ``fedgrid.config_checks``; the key groups (which command
uses which key) in ``fedgrid.config_groups``, re-exported here.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

import tomllib

from fedgrid.config_checks import validate
from fedgrid.config_compression import CompressionKeys, RunCodecs, run_codecs
from fedgrid.config_groups import (
    AGGREGATOR_NAMES,
    CLIENT_ONLY_KEYS,
    CLIENT_SIDE_KEYS,
    COORDINATOR_ONLY_KEYS,
    ENGINES,
    LR_DEFAULT,
    PRIVACY_KEYS,
    QUORUM_KEYS,
    REGION_ONLY_KEYS,
    SELECTORS,
    SIMULATION_ONLY_KEYS,
    STRATEGY_KEYS,
    STRATEGY_NAMES,
)
from fedgrid.config_llm import LlmKeys
from fedgrid.config_privacy import PrivacyKeys
from fedgrid.config_region import RegionKeys
from fedgrid.config_secagg import SecAggKeys
from fedgrid.config_values import coerce, parse_text
from fedgrid.config_values import key as _key
from fedgrid.constants import CHUNK_SIZE, HEARTBEAT_INTERVAL_S, MAX_NUM_EXAMPLES
from fedgrid.errors import ConfigError

__all__ = [
    "Config",
    "load_config",
    "config_keys",
    "key_type",
    "did_you_mean",
    "parse_flag",
    "parse_flags",
    "SELECTORS",
    "ENGINES",
    "STRATEGY_KEYS",
    "SIMULATION_ONLY_KEYS",
    "COORDINATOR_ONLY_KEYS",
    "CLIENT_ONLY_KEYS",
    "CLIENT_SIDE_KEYS",
    "REGION_ONLY_KEYS",
    "QUORUM_KEYS",
    "PRIVACY_KEYS",
]

log = logging.getLogger(__name__)
#: The table of a run directory's ``config.toml`` that records what the run ran on
#: (``fedgrid.determinism.environment``); informational when the file is loaded again.
ENVIRONMENT_TABLE = "environment"

_KINDS: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


@dataclass(frozen=True)
class _CoreKeys:
    """The keys of the training loop, the transport, the server and simulation (``--help`` shows
    them in this order, then those of the groups ``Config`` also inherits)."""

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
        "uplink codec NAME[:PARAM][+zstd] (none, fp16, bf16, int8, qsgd:L, topk:F, randk:F, powersgd:R, sign, "
        "and for outer gradients int4, fp4, sparseloco, demo)",
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
        LR_DEFAULT,
    )
    seed: int = _key("seed for model init, partitioning, sampling and shuffling", 0)
    dataset: str = _key(
        "built-in dataset: digits, fashion-mnist, shakespeare, synthetic or text (data, default model, server-side evaluation), or hf:PATH, your own local data (a save_to_disk folder or json/jsonl/csv/parquet files) for a language model",
        "digits",
    )
    data_dir: str = _key(
        "folder of the dataset's files (fashion-mnist: the four idx.gz files; shakespeare: see the README)",
        "",
    )
    text_column: str = _key(
        "--dataset hf:PATH: the column of the text a language model trains on (several, comma-separated, are joined per row: prompt,completion)",
        "text",
    )
    label_column: str = _key(
        "--dataset hf:PATH: the label column the dirichlet and shard partitions split by (or label=COL in the partition)",
        "",
    )
    model: str = _key(
        "a built-in model of the dataset (digits: mlp, logistic; fashion-mnist: mlp, cnn, logistic; shakespeare: lstm, or the language models gpt[:layers=L,heads=H,dim=D,context=T,tie=0|1] and hf:PATH, a local Hugging Face causal LM folder; synthetic: logistic), or MODULE:FACTORY returning your nn.Module (no server-side evaluation); empty: the dataset's default",
        "",
    )
    precision: str = _key(
        "forward passes of the built-in clients and the server-side evaluation: auto (bf16 autocast on CUDA devices that support it, else float32), bf16 (autocast, also on the CPU) or fp32; the batched engine trains fp32 only",
        "fp32",
    )
    initial_model: str = _key(
        "fedgrid coordinator: a safetensors file holding the initial global model (instead of building --model)",
        "",
    )
    app: str = _key("MODULE:FACTORY(partition, num_partitions, seed) -> Client for simulated clients", "")
    partition: str = _key(
        "how the data is split among clients: iid, dirichlet:ALPHA, shards:N (N label-sorted shards per client) or natural; empty: the dataset's default (dirichlet:0.5; natural for shakespeare and synthetic); --dataset hf:PATH: iid (default), dirichlet:A:label=COL, shard:K or natural:COL",
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
    progress: bool = _key(
        "fedgrid simulate: a progress line (clients/s, ETA) rewritten in place on stderr, when it is a terminal",
        True,
    )
    quiet: bool = _key(
        "no progress inside a task: a client logs no progress lines (steps, examples/s, time left; its heartbeats still carry them to the status page), fedgrid simulate draws no progress bar",
        False,
    )
    replay: str = _key(
        "fedgrid simulate: a min_quorum deployment's RUN_DIR/events.jsonl; each round merges exactly the results it records, each trained from its task round's model (bit for bit the deployment's model)",
        "",
    )
    strategy: str = _key(
        "aggregation strategy: "
        + ", ".join(STRATEGY_NAMES)
        + ", or your own as MODULE:CLASS (a fedgrid.Strategy subclass or a factory returning one)",
        "fedavg",
    )
    # Strategy and aggregator options: None (absent) keeps the strategy's own default; an
    # option set for a strategy it does not apply to is an error (see aggregation/by_name.py).
    aggregator: str | None = _key(
        "robust aggregation rule: " + ", ".join(AGGREGATOR_NAMES) + " (default mean)", None
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
    sync_delay_steps: int | None = _key(
        "diloco, streaming-diloco: tau, inner steps a worker keeps training after it sends, before it merges "
        "the new global values (overlapped sync; default 0: wait for them; at most inner_steps)",
        None,
    )
    merge_alpha: float | None = _key(
        "diloco, streaming-diloco: alpha in [0, 1], the share of the local values kept at a merge: "
        "local = alpha * local + (1 - alpha) * global (default 0 with sync_delay_steps 0, else 0.5)",
        None,
    )
    inner_time_s: float | None = _key(
        "diloco, streaming-diloco: run inner steps for this many seconds of compute (at least one) instead "
        "of inner_steps, so workers of different speeds arrive together (default 0: off; not bit-reproducible)",
        None,
    )
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
    max_update_ratio: float = _key(
        "refuse an update farther (L2, floating tensors) from the round's model than this times the round's median distance (0: off)",
        10.0,
    )
    min_update_cosine: float = _key(
        "refuse an update whose cosine with the coordinate-wise median of the round's fresh updates is under this, in a round of 3 updates or more (-1: off)",
        -0.5,
    )
    max_deviation_ratio: float = _key(
        "refuse an update farther (L2) from the coordinate-wise median of the round's fresh updates than this times their median distance from it, in a round of 3 updates or more (0: off)",
        3.0,
    )
    max_weight_ratio: float = _key(
        "an update's claimed num_examples counts for at most this times the round's median claim (0: no cap)",
        10.0,
    )
    max_weight_share: float = _key(
        "no identity's claims count for more than this share of a round's weight, after max_weight_ratio and client_quotas, in a round of 3 identities or more (0: off; a share under 1/n of n identities is 1/n)",
        0.5,
    )
    client_quotas: str = _key(
        'TOML file of "identity" = examples lines: the most examples each identity\'s claim counts for (cross-silo)',
        "",
    )
    round_timeout_s: float = _key("each round closes by this deadline", 300.0)
    eval_every: int = _key(
        "the server-side evaluation of the global model (the dataset's test set) runs every this many rounds and after the last one; the rounds between wait for no evaluation",
        1,
    )
    eval_batches: int = _key(
        "the server-side evaluation reads at most this many batches of the test split (a fixed subset of it): 1024 examples each, a language model's 8192 tokens each; the default keeps each built-in task's evaluation to a few seconds (the fashion-mnist CNN's: 3 s on one core)",
        4,
    )
    min_quorum: int = _key(
        "semi-asynchronous rounds: K, a round closes once K of its selected clients reported (0: off, every round waits for all); the others keep their task and their result is merged into a later round",
        0,
    )
    grace_s: float = _key(
        "min_quorum: seconds a round stays open for more results after its quorum (0: close at the quorum)",
        0.0,
    )
    max_staleness: int = _key(
        "min_quorum: S, a late result more than S rounds older than the round it would be merged into is refused",
        4,
    )
    staleness_exponent: float = _key(
        "min_quorum: a, a late result's weight is num_examples * (1 + staleness) ** -a (FedBuff)", 0.5
    )
    join_timeout_s: float = _key("longest wait for min_clients before a round", 600.0)
    heartbeat_interval_s: float = _key("client heartbeat interval", HEARTBEAT_INTERVAL_S)
    chunk_size: int = _key("payload bytes per wire chunk", CHUNK_SIZE)
    listen: str = _key(
        "coordinator address HOST:PORT (port 0 picks a free one); loopback by default: any other host "
        "(0.0.0.0: every interface) needs ca/cert/key, or insecure",
        "127.0.0.1:50051",
    )
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
    http_linger_s: float = _key(
        "coordinator, with http: once the run finished, how long the HTTP server waits for a reader of "
        "/api/status seen within that time (the status page) to fetch the final state before the "
        "coordinator exits; an unwatched run never waits; 0: stop at once",
        10.0,
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
    out: str = _key("run directory", "")
    state_dir: str = _key("durable coordinator state directory", "")
    fresh: bool = _key("start a new run though state_dir holds one (its files move to discarded-*/)", False)
    state_key: str = _key("file of a key (>= 32 bytes) authenticating checkpoints with HMAC-SHA256", "")


@dataclass(frozen=True)
class Config(LlmKeys, CompressionKeys, SecAggKeys, PrivacyKeys, RegionKeys, _CoreKeys):
    """Every setting of a run; each key's ``--help`` text is its field's. An area's keys may
    come from a group of its own module, a frozen dataclass of ``fedgrid.config_values.key``
    fields that this class inherits (listed before ``_CoreKeys``, so that they follow it)."""

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @functools.cached_property
    def codecs(self) -> RunCodecs:
        """The run's codecs (``codec``, ``region_codecs``, ``downlink_codec``, ``lan_codec``),
        parsed once, when the configuration is checked: the rest of the run takes these values."""
        return run_codecs(self)

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


def parse_flag(key: str, text: str) -> Any:
    """A command-line flag's text as the key's type (``--rounds 5`` is the integer 5).

    Raises:
        ConfigError: text that is not of the key's type (names the key), or an unknown key.
    """
    fields_ = config_keys()
    if key not in fields_:
        raise ConfigError(key, f"unknown key{did_you_mean(key, fields_)}")
    return parse_text(key, text, key_type(fields_[key])[0])


def parse_flags(texts: Mapping[str, str | None]) -> dict[str, Any]:
    """``parse_flag`` of every key given (``None``: not given, left out)."""
    return {key: parse_flag(key, text) for key, text in texts.items() if text is not None}


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
            values[key] = coerce(key, value, types[key])
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in keys:
            raise ConfigError(key, f"unknown key{did_you_mean(key, keys)}")
        values[key] = coerce(key, value, types[key])
    return Config(**values)
