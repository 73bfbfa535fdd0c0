"""``fedgrid launch TOPOLOGY.toml``: a whole multi-region federation as local processes, with one command.

The topology ``docker/compose.yaml`` deploys in containers, run on one machine (what
NVFlare calls POC mode): a CA and every certificate, the global coordinator, each region's
aggregator (``fedgrid region``) and its clients, all over mutual TLS on loopback. Each
process is a ``fedgrid`` command (``python -m fedgrid.cli``), so this module imports no
coordinator, region or client code: what runs here is what runs in the containers.

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
clients (the coordinator initializes and evaluates the model they train). A region's
``min_clients`` defaults to its client count, the global one to the number of regions.

Under ``--out``: ``certs/``; ``global/`` (the coordinator's run directory, ``state/``,
``coordinator.log``); per region ``NAME/`` (its run directory with ``wan.jsonl``,
``state/``, ``region.log``, ``client-I.log`` and ``client-state/``).

While the run goes it prints one line per global round (from ``global/metrics.jsonl``).
It exits 0 once the global run finished and every process exited 0; a process that fails
stops the rest (exit 1, naming it and its log's last line). Ctrl-C or SIGTERM stops
everything: SIGTERM to each process, ``LAUNCH_STOP_GRACE_S`` to stop, then SIGKILL; exit
128 + the signal's number. The processes run in sessions of their own, so a terminal's
Ctrl-C reaches only the launcher, which then stops them itself; on Linux each also gets
SIGTERM if the launcher itself dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TextIO

from fedgrid.config import CLIENT_ONLY_KEYS, REGION_ONLY_KEYS, SIMULATION_ONLY_KEYS, config_keys, did_you_mean, load_config
from fedgrid.constants import FINISH_GRACE_S, LAUNCH_START_TIMEOUT_S, LAUNCH_STOP_GRACE_S
from fedgrid.errors import ConfigError, FedgridError
from fedgrid.interrupts import GracefulStop, say

__all__ = ["Topology", "RegionSpec", "Identity", "TopologyError", "LaunchFailed", "load_topology", "make_certificates",
           "coordinator_argv", "region_argv", "client_argv", "Launcher", "add_parser", "command", "FEDGRID"]

#: How each process is started: this interpreter, so a virtual environment's fedgrid runs.
FEDGRID = (sys.executable, "-m", "fedgrid.cli")
#: Set by the launcher for every tier, so refused in the file (the seed: the global table's).
MANAGED_KEYS = frozenset({"listen", "out", "state_dir", "ca", "cert", "key", "crl", "insecure", "enroll_listen", "enroll_dir",
                          "upstream", "upstream_ca", "upstream_cert", "upstream_key", "upstream_server_name"})
_COORDINATOR = frozenset(config_keys()) - SIMULATION_ONLY_KEYS - CLIENT_ONLY_KEYS - REGION_ONLY_KEYS
GLOBAL_KEYS = _COORDINATOR - MANAGED_KEYS
#: ``fedgrid region`` takes no run length, model, enrollment or status server: the global coordinator has them.
REGION_KEYS = (_COORDINATOR - {"rounds", "initial_model", "model", "http", "http_token_file", "seed"} | REGION_ONLY_KEYS
               | {"regional_rounds"}) - MANAGED_KEYS
#: ``fedgrid client``'s config keys (``partition`` is its ``--data-partition``).
CLIENT_KEYS = frozenset({"dataset", "data_dir", "model", "batch_size", "optimizer", "lr", "momentum", "weight_decay", "partition",
                         "threads"}) | CLIENT_ONLY_KEYS
#: ``[global]`` keys the clients take too: their data and model are the coordinator's.
SHARED_WITH_CLIENTS = ("dataset", "data_dir", "model")
#: A region's name names files, certificates and its client identity upstream.
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: How often the launcher looks at its processes and the global metrics.
POLL_S = 0.1


class TopologyError(ConfigError):
    """A topology file that cannot be run: the message names the file and the key."""

    def __init__(self, path: str, key: str, problem: str) -> None:
        FedgridError.__init__(self, f"{path}: key '{key}': {problem}" if key else f"{path}: {problem}")
        self.key = key


class LaunchFailed(FedgridError):
    """A process of the topology failed, or did not start or finish in time (the message names it and its log)."""


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


def _check_keys(path: str, where: str, table: Mapping[str, Any], allowed: frozenset[str], extra: Sequence[str] = ()) -> None:
    for key in table:
        if key in MANAGED_KEYS or (key == "seed" and where != "global"):
            raise TopologyError(path, f"{where}.{key}", "is set by fedgrid launch (addresses, directories, certificates, the "
                                "global seed); leave it out")
        if key not in allowed and key not in extra:
            raise TopologyError(path, f"{where}.{key}", f"unknown key{did_you_mean(key, [*allowed, *extra], otherwise='')}")


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
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise TopologyError(where, "", "no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(where, "", f"not valid TOML: {exc}") from None
    for key in data:
        if key not in ("global", "clients", "regions"):
            raise TopologyError(where, key, f"unknown table{did_you_mean(key, ['global', 'clients', 'regions'], otherwise='')} "
                                "(the file has [global], [clients] and [[regions]])")
    top = _table(data, "global", where)
    clients = _table(data, "clients", where)
    _check_keys(where, "global", top, GLOBAL_KEYS)
    _check_keys(where, "clients", clients, CLIENT_KEYS, ["num_partitions"])
    if rounds is not None:
        top["rounds"] = _int(where, "--rounds", rounds, low=1)
    regions_data = data.get("regions")
    if not isinstance(regions_data, list) or not regions_data or not all(isinstance(r, dict) for r in regions_data):
        raise TopologyError(where, "regions", "needs at least one [[regions]] table (name, clients or partitions, ...)")
    regions: list[RegionSpec] = []
    taken: dict[int, str] = {}
    next_partition = 0
    for i, raw in enumerate(regions_data):
        table = dict(raw)
        name = table.pop("name", None)
        label = f"regions[{i}]"
        if not isinstance(name, str) or not NAME.fullmatch(name) or name in ("global", "certs"):
            raise TopologyError(where, f"{label}.name", f"must be 1-64 of [A-Za-z0-9._-], not 'global' or 'certs', got {name!r}")
        if any(r.name == name for r in regions):
            raise TopologyError(where, f"{label}.name", f"{name!r} names two regions")
        label = f"regions.{name}"
        count = table.pop("clients", None)
        partitions = table.pop("partitions", None)
        _check_keys(where, label, table, REGION_KEYS)
        if partitions is None:
            if count is None:
                raise TopologyError(where, f"{label}.clients", "give clients = N or partitions = [I, ...]")
            partitions = list(range(next_partition, next_partition + _int(where, f"{label}.clients", count, low=1)))
        elif not isinstance(partitions, list) or not partitions or not all(isinstance(p, int) and not isinstance(p, bool) for p in partitions):
            raise TopologyError(where, f"{label}.partitions", f"must be a non-empty list of partition indices, got {partitions!r}")
        elif count is not None and _int(where, f"{label}.clients", count, low=1) != len(partitions):
            raise TopologyError(where, f"{label}.clients", f"is {count} but partitions lists {len(partitions)}")
        for p in partitions:
            if p in taken:
                raise TopologyError(where, f"{label}.partitions", f"partition {p} is also {taken[p]}'s")
            taken[p] = name
        next_partition = max(partitions) + 1
        table.setdefault("min_clients", len(partitions))
        _checked(where, label, {**table, "name": name})
        regions.append(RegionSpec(name, tuple(partitions), table))
    num_partitions = _int(where, "clients.num_partitions", clients.pop("num_partitions", len(taken)), low=1)
    outside = sorted(p for p in taken if not 0 <= p < num_partitions)
    if outside:
        raise TopologyError(where, "clients.num_partitions", f"is {num_partitions}, but partition {outside[0]} "
                            f"({taken[outside[0]]}'s) is outside 0..{num_partitions - 1}")
    top.setdefault("min_clients", len(regions))
    _checked(where, "global", top)
    from fedgrid.compression.registry import parse_region_codecs

    unknown = sorted(set(parse_region_codecs(str(top.get("region_codecs", "")))) - {r.name for r in regions})
    if unknown:
        raise TopologyError(where, "global.region_codecs", f"names {unknown[0]!r}, which is no region of the file "
                            f"({', '.join(r.name for r in regions)})")
    for key in SHARED_WITH_CLIENTS:
        if key in clients:
            raise TopologyError(where, f"clients.{key}", f"goes in [global] (the launcher gives it to the clients): the "
                                "global coordinator initializes and evaluates the model the clients train")
        if key in top:
            clients[key] = top[key]
    _checked(where, "clients", clients)
    names = ["global", "probe", *(n for r in regions for n in (r.name, f"{r.name}-lan")), *(f"client-{p}" for p in taken)]
    clash = next((n for n in names if names.count(n) > 1), None)
    if clash is not None:
        raise TopologyError(where, "regions", f"the certificate name {clash!r} would be two identities (a region's name "
                            "is its client identity, NAME-lan its server's, client-I its clients')")
    return Topology(where, top, tuple(regions), num_partitions, clients)


def _flags(keys: Mapping[str, Any]) -> list[str]:
    """``--key value`` for each key (booleans as true/false, which every fedgrid flag parses)."""
    out: list[str] = []
    for key, value in keys.items():
        flag = "--data-partition" if key == "partition" else "--" + key.replace("_", "-")
        out += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def coordinator_argv(top: Topology, *, listen: str, out: str, state_dir: str, tls: Identity) -> list[str]:
    """``fedgrid coordinator``'s arguments for the topology's global tier."""
    return ["coordinator", "--listen", listen, "--out", out, "--state-dir", state_dir, *tls.flags(), *_flags(top.global_keys)]


def region_argv(top: Topology, region: RegionSpec, *, upstream: str, listen: str, out: str, state_dir: str, tls: Identity,
                upstream_tls: Identity, upstream_server_name: str = "") -> list[str]:
    """``fedgrid region``'s arguments: it serves its LAN with ``tls`` and joins ``upstream`` with ``upstream_tls``."""
    server_name = ["--upstream-server-name", upstream_server_name] if upstream_server_name else []
    return ["region", "--name", region.name, "--upstream", upstream, *upstream_tls.flags("upstream-"), *server_name,
            "--listen", listen, "--out", out, "--state-dir", state_dir, *tls.flags(), "--seed", str(top.seed), *_flags(region.keys)]


def client_argv(top: Topology, partition: int, *, coordinator: str, state_dir: str, tls: Identity, server_name: str = "") -> list[str]:
    """``fedgrid client``'s arguments for global partition ``partition``, joining its region at ``coordinator``."""
    name = ["--server-name", server_name] if server_name else []
    return ["client", "--coordinator", coordinator, *name, "--partition", f"{partition}/{top.num_partitions}", "--seed", str(top.seed),
            *tls.flags(), "--state-dir", state_dir, *_flags(top.client_keys)]


def make_certificates(directory: Path, top: Topology) -> dict[str, Identity]:
    """A CA in ``directory`` and each process's certificate, for loopback (servers: ``localhost``, ``127.0.0.1``).

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
        cert, key = pki.issue(directory, name, server=name in servers)
        identities[name] = Identity(ca, str(cert), str(key))
    return identities


@dataclass
class _Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


def _session_of_its_own(launcher: int) -> None:
    """In the child, before exec: a session of its own (a terminal's Ctrl-C reaches only the
    launcher), and SIGTERM when the launcher dies (Linux), so no process outlives it."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # the launcher died before prctl took effect
            os._exit(1)


def _status(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


class _Stopped(Exception):
    """A signal asked the launcher to stop."""


class _TimedOut(LaunchFailed):
    """A wait's deadline passed."""


class Launcher:
    """Runs a ``Topology`` under ``out``: certificates, coordinator, regions, clients; then watches them.

    Args:
        top: the checked topology.
        out: the launch's directory (made here; must be empty or absent: a state directory
            that holds a run would resume it).
        stream: where the status lines go.
    """

    def __init__(self, top: Topology, out: Path, *, stream: TextIO = sys.stdout) -> None:
        self.top, self.out, self.stream = top, out, stream
        self.processes: list[_Process] = []
        self._stop = threading.Event()
        self._signal: str | None = None
        self._metrics_offset = 0
        #: Global rounds printed so far.
        self.rounds_done = 0

    def say(self, line: str) -> None:
        print(f"fedgrid launch: {line}", file=self.stream, flush=True)

    def run(self) -> int:
        """Starts the topology and waits for the global run to finish.

        Returns:
            0: the run finished and every process exited 0; 128 + N: stopped by signal N.
        Raises:
            LaunchFailed: a process failed, did not start or did not finish (named; the others stopped).
        """
        if self.out.exists() and any(self.out.iterdir()):
            raise LaunchFailed(f"{self.out} is not empty: give a new --out (the state directories in it would resume "
                               "the run that is there)")

        def on_signal(name: str) -> None:
            self._signal = name
            self._stop.set()

        with GracefulStop(on_signal, what="launch"):
            try:
                self._start()
                self._watch()
            except _Stopped:
                stopped, killed = self._stop_all()
                say(f"fedgrid launch: {self._signal}: stopped {stopped} processes" + (f" ({killed} killed after "
                    f"{LAUNCH_STOP_GRACE_S:g}s)" if killed else "") + f"; run directories under {self.out}", stream=self.stream)
                return 128 + int(getattr(signal, self._signal or "SIGTERM"))
            except BaseException:
                self._stop_all()
                raise
        self.say(f"run finished: {self.rounds_done} global rounds; model {self.out / 'global' / 'model.safetensors'}; "
                 f"run directories under {self.out}")
        return 0

    def _spawn(self, name: str, argv: Sequence[str], log: Path) -> _Process:
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log, "wb") as sink:
            popen = subprocess.Popen([*FEDGRID, *argv], stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=functools.partial(_session_of_its_own, os.getpid()))  # the launcher runs no other thread
        process = _Process(name, popen, log)
        self.processes.append(process)
        return process

    def _wait(self, condition: Callable[[], bool], *, timeout: float, what: str) -> None:
        """Polls ``condition`` until it holds; a signal, a failed process or the deadline ends the wait."""
        deadline = time.monotonic() + timeout
        while not condition():
            self._check_exits()
            if time.monotonic() > deadline:
                raise _TimedOut(f"timed out after {timeout:g}s waiting for {what}")
            if self._stop.wait(POLL_S):
                raise _Stopped

    def _address(self, process: _Process, run_dir: Path) -> str:
        """What ``process`` wrote to ``RUN_DIR/address`` once it listens."""
        path = run_dir / "address"

        def listening() -> bool:
            if path.exists() and path.read_text().strip() != "":
                return True
            if process.popen.poll() == 0:  # a failure is _check_exits'
                raise LaunchFailed(f"{process.name} exited before it listened: {_last_line(process.log)} (log {process.log})")
            return False

        try:
            self._wait(listening, timeout=LAUNCH_START_TIMEOUT_S, what=f"{process.name}'s address")
        except _TimedOut:
            raise LaunchFailed(f"{process.name} wrote no address to {path} within {LAUNCH_START_TIMEOUT_S:g}s "
                               f"(FEDGRID_LAUNCH_START_TIMEOUT_S); its log {process.log} ends: {_last_line(process.log)}") from None
        return path.read_text().strip()

    def _start(self) -> None:
        top, out = self.top, self.out
        ids = make_certificates(out / "certs", top)
        if self._stop.is_set():
            raise _Stopped
        run_dir = out / "global"
        coordinator = self._spawn("coordinator", coordinator_argv(top, listen="127.0.0.1:0", out=str(run_dir), state_dir=str(run_dir / "state"),
                                                                  tls=ids["global"]), run_dir / "coordinator.log")
        address = self._address(coordinator, run_dir)
        self.say(f"coordinator on {address}: {top.rounds} global rounds, {len(top.regions)} regions (run directory {run_dir})")
        started = []
        for region in top.regions:  # all regions start at once: each takes seconds to import torch
            region_dir = out / region.name
            argv = region_argv(top, region, upstream=address, listen="127.0.0.1:0", out=str(region_dir), state_dir=str(region_dir / "state"),
                               tls=ids[f"{region.name}-lan"], upstream_tls=ids[region.name])
            started.append((region, region_dir, self._spawn(region.name, argv, region_dir / "region.log")))
        for region, region_dir, process in started:
            region_address = self._address(process, region_dir)
            for p in region.partitions:
                self._spawn(f"client-{p}", client_argv(top, p, coordinator=region_address, state_dir=str(region_dir / "client-state"),
                                                       tls=ids[f"client-{p}"]), region_dir / f"client-{p}.log")
            self.say(f"region {region.name} on {region_address}: {len(region.partitions)} client{'s' if len(region.partitions) > 1 else ''} (partitions "
                     f"{', '.join(map(str, region.partitions))} of {top.num_partitions}), run directory {region_dir}")

    def _check_exits(self) -> None:
        for process in self.processes:
            status = process.popen.poll()
            if status not in (None, 0):
                raise LaunchFailed(f"{process.name} {_status(status)}: {_last_line(process.log)} (log {process.log})")

    def _watch(self) -> None:
        coordinator = self.processes[0]

        def finished() -> bool:
            self._print_rounds()
            return coordinator.popen.poll() == 0

        self._wait(finished, timeout=float("inf"), what="the global run")  # the coordinator's own deadlines bound it
        self._print_rounds()
        finish = 2 * FINISH_GRACE_S + LAUNCH_STOP_GRACE_S  # a region tells its clients, then finishes itself
        try:
            self._wait(lambda: all(p.popen.poll() is not None for p in self.processes), timeout=finish, what="the regions and clients to finish")
        except _TimedOut:
            running = [p.name for p in self.processes if p.popen.poll() is None]
            raise LaunchFailed(f"the global run finished but {', '.join(running)} did not exit within {finish:g}s") from None

    def _print_rounds(self) -> None:
        """Prints a status line for each global round ``global/metrics.jsonl`` gained since the last look."""
        path = self.out / "global" / "metrics.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(self._metrics_offset)
                text = f.read()
        except FileNotFoundError:
            return
        complete = text[: text.rfind(b"\n") + 1]  # a line still being written waits for the next look
        self._metrics_offset += len(complete)
        for line in complete.decode().splitlines():
            if line.strip():
                self.rounds_done += 1
                self.say(round_line(json.loads(line), rounds=self.top.rounds, regions=[r.name for r in self.top.regions]))

    def _stop_all(self) -> tuple[int, int]:
        """SIGTERM to every running process, then SIGKILL to those still running after the grace; returns (stopped, killed)."""
        running = [p for p in self.processes if p.popen.poll() is None]
        for p in running:
            p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + LAUNCH_STOP_GRACE_S
        killed = 0
        for p in running:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
                killed += 1
        return len(running), killed


def _size(n: float) -> str:
    """Bytes as kB under a megabyte (a small model's update is tens of kB), else MB."""
    return f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:.2f} MB"


def round_line(row: Mapping[str, Any], *, rounds: int, regions: Sequence[str]) -> str:
    """The status line of one global round (a ``metrics.jsonl`` row): loss, accuracy, regions, WAN bytes per region."""
    def number(key: str) -> str:
        value = row.get(key)
        return f"{value:.4f}" if isinstance(value, (int, float)) else "-"

    per_region = ", ".join(f"{name} {_size(row.get(f'bytes_up.{name}', 0))}/{_size(row.get(f'bytes_down.{name}', 0))}" for name in regions)
    return (f"global round {row['round']}/{rounds}: loss {number('loss')}, accuracy {number('accuracy')}; regions "
            f"{row['clients_ok']} ok, {row['clients_failed']} failed; WAN {_size(row['bytes_up'])} up, {_size(row['bytes_down'])} down "
            f"(up/down: {per_region}); {float(row['wall_s']):.2f}s")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds ``launch`` to the ``fedgrid`` subcommands (``sub``: argparse's subparsers)."""
    parser = sub.add_parser("launch", help="run a multi-region topology (docker/topology.toml) as local processes over mutual TLS")
    parser.add_argument("topology", metavar="TOPOLOGY.toml", help="the topology: [global], [clients], [[regions]] (see docker/topology.toml)")
    parser.add_argument("--rounds", type=int, default=None, metavar="N", help="global rounds (default: the file's [global] rounds)")
    parser.add_argument("--out", default=None, metavar="DIR", help="where certificates, run directories and logs go "
                        "(empty or new; default runs/launch-TIME)")
    return parser


def command(args: argparse.Namespace) -> int:
    """``fedgrid launch``: a bad topology exits 2 naming the key; a failed process 1; a signal 128 + N."""
    top = load_topology(args.topology, rounds=args.rounds)
    out = Path(args.out or f"runs/launch-{time.strftime('%Y%m%d-%H%M%S')}")
    return Launcher(top, out).run()
