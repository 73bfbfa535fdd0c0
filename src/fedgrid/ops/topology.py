"""A topology file for ``fedgrid launch``: what it may hold, how it is checked, and the
``fedgrid`` command lines and certificates it becomes.

The topology file::

    [global]                 # fedgrid coordinator's keys: rounds, seed, strategy, codec,
    rounds = 10              # region_codecs (each region's WAN uplink), min_clients, ...
    region_codecs = "region-a=int8,region-b=int8"

    [clients]                # every client: fedgrid client's keys (partition, batch_size, lr,
    threads = 1              # threads, ...) and num_partitions (default: all clients)

    [[regions]]              # one table per region: fedgrid region's keys (regional_rounds,
    name = "region-a"        # strategy, codec = the LAN uplink, min_clients, ...), and its
    regional_rounds = 2      # clients: clients = N and/or partitions = [I, ...] (the global
    codec = "bf16"           # partition indices; default: the next N)
    partitions = [0, 1, 2]

The launcher sets what ties the tiers together, and refuses it in the file: addresses
(every server on ``127.0.0.1:0``, the address read back from ``RUN_DIR/address``), run and
state directories, certificates, each region's upstream, and the seed, which is the global
table's everywhere (partition I/N must be the same data in every client). ``dataset``,
``data_dir`` and ``model`` go in ``[global]`` only, and the launcher gives them to the
clients (the coordinator initializes and evaluates the model they train); ``hf:PATH`` data's
``text_column`` and ``label_column`` go in a clients table. A region's
``min_clients`` defaults to its client count, the global one to the number of regions.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import tomllib

from fedgrid.config import (
    CLIENT_ONLY_KEYS,
    CLIENT_SIDE_KEYS,
    PRIVACY_KEYS,
    QUORUM_KEYS,
    REGION_ONLY_KEYS,
    SIMULATION_ONLY_KEYS,
    config_keys,
    did_you_mean,
    load_config,
)
from fedgrid.errors import ConfigError, FedgridError

__all__ = [
    "Topology",
    "RegionSpec",
    "Identity",
    "TopologyError",
    "load_topology",
    "make_certificates",
    "coordinator_argv",
    "region_argv",
    "client_argv",
    "GLOBAL_KEYS",
    "REGION_KEYS",
    "CLIENT_KEYS",
    "MANAGED_KEYS",
]

#: Set by the launcher for every tier, so refused in the file (the seed: the global table's).
MANAGED_KEYS = frozenset(
    {
        "listen",
        "out",
        "state_dir",
        "ca",
        "cert",
        "key",
        "crl",
        "insecure",
        "enroll_listen",
        "enroll_dir",
        "upstream",
        "upstream_ca",
        "upstream_cert",
        "upstream_key",
        "upstream_server_name",
    }
)
_COORDINATOR = (
    frozenset(config_keys()) - SIMULATION_ONLY_KEYS - CLIENT_ONLY_KEYS - REGION_ONLY_KEYS - CLIENT_SIDE_KEYS
)
GLOBAL_KEYS = _COORDINATOR - MANAGED_KEYS
#: ``fedgrid region`` takes no run length, enrollment, status server, quorum or privacy budget: the
#: global coordinator has them (its ``model`` is a ``--peft`` run's base to hash, ``[global]``'s by default).
REGION_KEYS = (
    _COORDINATOR
    - {
        "rounds",
        "initial_model",
        "http",
        "http_token_file",
        "http_linger_s",
        "seed",
        "eval_every",
        "eval_batches",
    }
    - QUORUM_KEYS
    - PRIVACY_KEYS
    | REGION_ONLY_KEYS
    | {"regional_rounds"}
) - MANAGED_KEYS
#: ``fedgrid client``'s config keys (``partition`` is its ``--data-partition``).
CLIENT_KEYS = (
    frozenset(
        {
            "dataset",
            "data_dir",
            "text_column",
            "label_column",
            "model",
            "batch_size",
            "optimizer",
            "lr",
            "momentum",
            "weight_decay",
            "precision",
            "peft",
            "peft_rank",
            "lora_aggregation",
            "grad_accum",
            "grad_checkpointing",
            "quiet",
            "partition",
            "threads",
        }
    )
    | CLIENT_ONLY_KEYS
)
#: ``[global]`` keys the clients take too: their data, model and adapters are the coordinator's.
SHARED_WITH_CLIENTS = ("dataset", "data_dir", "model", "peft", "lora_aggregation")
#: A region's name names files, certificates and its client identity upstream.
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


class TopologyError(ConfigError):
    """A topology file that cannot be run: the message names the file and the key."""

    def __init__(self, path: str, key: str, problem: str) -> None:
        FedgridError.__init__(self, f"{path}: key '{key}': {problem}" if key else f"{path}: {problem}")
        self.key = key


@dataclass(frozen=True)
class RegionSpec:
    """One region: its name, the global partition indices of its clients, and its ``fedgrid region`` keys."""

    name: str
    partitions: tuple[int, ...]
    keys: Mapping[str, Any]


@dataclass(frozen=True)
class Topology:
    """A checked topology file (``load_topology``)."""

    path: str
    global_keys: Mapping[str, Any]
    regions: tuple[RegionSpec, ...]
    num_partitions: int
    client_keys: Mapping[str, Any]

    @property
    def rounds(self) -> int:
        return int(self.global_keys.get("rounds", config_keys()["rounds"].default))

    @property
    def seed(self) -> int:
        return int(self.global_keys.get("seed", 0))


@dataclass(frozen=True)
class Identity:
    """A process's TLS files: the CA bundle it trusts, its certificate and key."""

    ca: str
    cert: str
    key: str

    def flags(self, prefix: str = "") -> list[str]:
        return [f"--{prefix}ca", self.ca, f"--{prefix}cert", self.cert, f"--{prefix}key", self.key]


def _table(data: Mapping[str, Any], name: str, path: str) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise TopologyError(path, name, f"must be a table ([{name}]), got {value!r}")
    return dict(value)


def _check_keys(
    path: str, where: str, table: Mapping[str, Any], allowed: frozenset[str], extra: Sequence[str] = ()
) -> None:
    for key in table:
        if key in MANAGED_KEYS or (key == "seed" and where != "global"):
            raise TopologyError(
                path,
                f"{where}.{key}",
                "is set by fedgrid launch (addresses, directories, certificates, the "
                "global seed); leave it out",
            )
        if key not in allowed and key not in extra:
            raise TopologyError(
                path, f"{where}.{key}", f"unknown key{did_you_mean(key, [*allowed, *extra], otherwise='')}"
            )


def _checked(path: str, where: str, keys: Mapping[str, Any]) -> None:
    """The keys' values checked as ``fedgrid`` checks them (types, ranges, codec and strategy names)."""
    try:
        load_config(None, keys)
    except ConfigError as exc:
        problem = str(exc).removeprefix(f"config key '{exc.key}': ")
        raise TopologyError(path, f"{where}.{exc.key}", problem) from None


def _int(path: str, key: str, value: Any, *, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise TopologyError(path, key, f"must be an integer at least {low}, got {value!r}")
    return value


def load_topology(path: str | os.PathLike[str], *, rounds: int | None = None) -> Topology:
    """Reads and checks a topology file; ``rounds`` replaces ``[global] rounds``.

    Raises:
        TopologyError: unreadable or not TOML; an unknown, misplaced or launcher-managed key;
            a bad value (as ``fedgrid`` would refuse it); regions missing, unnamed, named
            twice; partitions out of range, taken twice or not matching ``clients``.
    """
    where = str(path)
    data = _read(where)
    top = _table(data, "global", where)
    clients = _table(data, "clients", where)
    _check_keys(where, "global", top, GLOBAL_KEYS)
    _check_keys(where, "clients", clients, CLIENT_KEYS, ["num_partitions"])
    if rounds is not None:
        top["rounds"] = _int(where, "--rounds", rounds, low=1)
    regions, taken = _regions(where, data.get("regions"))
    num_partitions = _int(where, "clients.num_partitions", clients.pop("num_partitions", len(taken)), low=1)
    outside = sorted(p for p in taken if not 0 <= p < num_partitions)
    if outside:
        raise TopologyError(
            where,
            "clients.num_partitions",
            f"is {num_partitions}, but partition {outside[0]} "
            f"({taken[outside[0]]}'s) is outside 0..{num_partitions - 1}",
        )
    top.setdefault("min_clients", len(regions))
    _checked(where, "global", top)
    _check_tiers(where, top, clients, regions, taken)
    return Topology(where, top, tuple(regions), num_partitions, clients)


def _read(where: str) -> dict[str, Any]:
    """The file's tables: ``[global]``, ``[clients]`` and ``[[regions]]``, nothing else."""
    try:
        data = tomllib.loads(Path(where).read_text())
    except FileNotFoundError:
        raise TopologyError(where, "", "no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(where, "", f"not valid TOML: {exc}") from None
    for key in data:
        if key not in ("global", "clients", "regions"):
            raise TopologyError(
                where,
                key,
                f"unknown table{did_you_mean(key, ['global', 'clients', 'regions'], otherwise='')} "
                "(the file has [global], [clients] and [[regions]])",
            )
    return data


def _regions(where: str, regions_data: Any) -> tuple[list[RegionSpec], dict[int, str]]:
    """The ``[[regions]]`` tables, checked, and which region each global partition is in."""
    if (
        not isinstance(regions_data, list)
        or not regions_data
        or not all(isinstance(r, dict) for r in regions_data)
    ):
        raise TopologyError(
            where, "regions", "needs at least one [[regions]] table (name, clients or partitions, ...)"
        )
    regions: list[RegionSpec] = []
    taken: dict[int, str] = {}
    next_partition = 0  # clients = N takes the N after the previous region's last
    for i, raw in enumerate(regions_data):
        table = dict(raw)
        name = table.pop("name", None)
        label = f"regions[{i}]"
        if not isinstance(name, str) or not NAME.fullmatch(name) or name in ("global", "certs"):
            raise TopologyError(
                where,
                f"{label}.name",
                f"must be 1-64 of [A-Za-z0-9._-], not 'global' or 'certs', got {name!r}",
            )
        if any(r.name == name for r in regions):
            raise TopologyError(where, f"{label}.name", f"{name!r} names two regions")
        label = f"regions.{name}"
        partitions = _partitions(where, label, table, next_partition=next_partition)
        for p in partitions:
            if p in taken:
                raise TopologyError(where, f"{label}.partitions", f"partition {p} is also {taken[p]}'s")
            taken[p] = name
        next_partition = max(partitions) + 1
        table.setdefault("min_clients", len(partitions))
        _checked(where, label, {**table, "name": name})
        regions.append(RegionSpec(name, tuple(partitions), table))
    return regions, taken


def _partitions(where: str, label: str, table: dict[str, Any], *, next_partition: int) -> list[int]:
    """A region's partitions: ``partitions = [I, ...]``, or ``clients = N`` from ``next_partition`` on."""
    count = table.pop("clients", None)
    partitions = table.pop("partitions", None)
    _check_keys(where, label, table, REGION_KEYS)
    if partitions is None:
        if count is None:
            raise TopologyError(where, f"{label}.clients", "give clients = N or partitions = [I, ...]")
        return list(range(next_partition, next_partition + _int(where, f"{label}.clients", count, low=1)))
    if (
        not isinstance(partitions, list)
        or not partitions
        or not all(isinstance(p, int) and not isinstance(p, bool) for p in partitions)
    ):
        raise TopologyError(
            where, f"{label}.partitions", f"must be a non-empty list of partition indices, got {partitions!r}"
        )
    if count is not None and _int(where, f"{label}.clients", count, low=1) != len(partitions):
        raise TopologyError(where, f"{label}.clients", f"is {count} but partitions lists {len(partitions)}")
    return partitions


def _check_tiers(
    where: str,
    top: dict[str, Any],
    clients: dict[str, Any],
    regions: Sequence[RegionSpec],
    taken: Mapping[int, str],
) -> None:
    """What ties the tiers together: region codecs name regions, the model keys are the global
    table's (given to the clients), and no two processes share a certificate name."""
    from fedgrid.compression.spec import parse_region_codecs

    unknown = sorted(set(parse_region_codecs(str(top.get("region_codecs", "")))) - {r.name for r in regions})
    if unknown:
        raise TopologyError(
            where,
            "global.region_codecs",
            f"names {unknown[0]!r}, which is no region of the file ({', '.join(r.name for r in regions)})",
        )
    for key in SHARED_WITH_CLIENTS:
        if key in clients:
            raise TopologyError(
                where,
                f"clients.{key}",
                "goes in [global] (the launcher gives it to the clients): the "
                "global coordinator initializes and evaluates the model the clients train",
            )
        if key in top:
            clients[key] = top[key]
    _checked(where, "clients", clients)
    names = [
        "global",
        "probe",
        *(n for r in regions for n in (r.name, f"{r.name}-lan")),
        *(f"client-{p}" for p in taken),
    ]
    clash = next((n for n in names if names.count(n) > 1), None)
    if clash is not None:
        raise TopologyError(
            where,
            "regions",
            f"the certificate name {clash!r} would be two identities (a region's name "
            "is its client identity, NAME-lan its server's, client-I its clients')",
        )


def _flags(keys: Mapping[str, Any]) -> list[str]:
    """``--key value`` for each key (booleans as true/false, which every fedgrid flag parses)."""
    out: list[str] = []
    for key, value in keys.items():
        flag = "--data-partition" if key == "partition" else "--" + key.replace("_", "-")
        out += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def coordinator_argv(top: Topology, *, listen: str, out: str, state_dir: str, tls: Identity) -> list[str]:
    """``fedgrid coordinator``'s arguments for the topology's global tier."""
    return [
        "coordinator",
        "--listen",
        listen,
        "--out",
        out,
        "--state-dir",
        state_dir,
        *tls.flags(),
        *_flags(top.global_keys),
    ]


def region_argv(
    top: Topology,
    region: RegionSpec,
    *,
    upstream: str,
    listen: str,
    out: str,
    state_dir: str,
    tls: Identity,
    upstream_tls: Identity,
    upstream_server_name: str = "",
) -> list[str]:
    """``fedgrid region``'s arguments: it serves its LAN with ``tls`` and joins ``upstream`` with ``upstream_tls``."""
    server_name = ["--upstream-server-name", upstream_server_name] if upstream_server_name else []
    # A --peft run's regions hash the base their clients train on: they take the model keys too.
    shared = top.global_keys if top.global_keys.get("peft") else {}
    model = {k: shared[k] for k in SHARED_WITH_CLIENTS if k in shared}
    return [
        "region",
        "--name",
        region.name,
        "--upstream",
        upstream,
        *upstream_tls.flags("upstream-"),
        *server_name,
        "--listen",
        listen,
        "--out",
        out,
        "--state-dir",
        state_dir,
        *tls.flags(),
        "--seed",
        str(top.seed),
        *_flags({**model, **region.keys}),
    ]


def client_argv(
    top: Topology, partition: int, *, coordinator: str, state_dir: str, tls: Identity, server_name: str = ""
) -> list[str]:
    """``fedgrid client``'s arguments for global partition ``partition``, joining its region at ``coordinator``."""
    name = ["--server-name", server_name] if server_name else []
    return [
        "client",
        "--coordinator",
        coordinator,
        *name,
        "--partition",
        f"{partition}/{top.num_partitions}",
        "--seed",
        str(top.seed),
        *tls.flags(),
        "--state-dir",
        state_dir,
        *_flags(top.client_keys),
    ]


def make_certificates(
    directory: Path, top: Topology, *, sans: Mapping[str, Sequence[str]] | None = None
) -> dict[str, Identity]:
    """A CA in ``directory`` and each process's certificate, for loopback (servers: ``localhost``,
    ``127.0.0.1``) unless ``sans`` names a server's addresses.

    Args:
        directory: where the CA and the certificates go (``fedgrid certs``' layout).
        top: the topology.
        sans: a server certificate's names and addresses (``global``, ``NAME-lan``) where its
            process listens elsewhere than on loopback (``fedgrid.ops.lab``'s hosts).
    Returns:
        Identity by process: ``global`` (the coordinator's server certificate), per region
        ``NAME`` (its client certificate upstream) and ``NAME-lan`` (its server
        certificate), per client ``client-I``.
    """
    from fedgrid.ops import pki

    pki.init_ca(directory, name="fedgrid launch CA")
    ca = str(directory / pki.CA_CERT)
    servers = ["global", *(f"{r.name}-lan" for r in top.regions)]
    clients = [*(r.name for r in top.regions), *(f"client-{p}" for r in top.regions for p in r.partitions)]
    identities = {}
    for name in [*servers, *clients]:
        cert, key = pki.issue(directory, name, server=name in servers, sans=(sans or {}).get(name, ()))
        identities[name] = Identity(ca, str(cert), str(key))
    return identities
