"""``fedgrid launch TOPOLOGY.toml``: a whole multi-region federation as local processes, with one command.

The topology ``docker/compose.yaml`` deploys in containers, run on one machine (what
NVFlare calls POC mode): a CA and every certificate, the global coordinator, each region's
aggregator (``fedgrid region``) and its clients, all over mutual TLS on loopback. Each
process is a ``fedgrid`` command (``python -m fedgrid.cli``), so this module imports no
coordinator, region or client code: what runs here is what runs in the containers.

The topology file and the command lines it becomes are ``fedgrid.ops.topology``.

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

``--emit k8s --out DIR`` runs nothing: it writes the topology as Kubernetes manifests
(``fedgrid.ops.k8s``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TextIO

from fedgrid.constants import FINISH_GRACE_S, LAUNCH_START_TIMEOUT_S, LAUNCH_STOP_GRACE_S
from fedgrid.errors import ConfigError, FedgridError
from fedgrid.interrupts import GracefulStop, say
from fedgrid.ops.topology import (  # noqa: F401 - the topology half, re-exported: one import gives the whole tool
    CLIENT_KEYS,
    GLOBAL_KEYS,
    MANAGED_KEYS,
    REGION_KEYS,
    Identity,
    RegionSpec,
    Topology,
    TopologyError,
    client_argv,
    coordinator_argv,
    load_topology,
    make_certificates,
    region_argv,
)

__all__ = [
    "Topology",
    "RegionSpec",
    "Identity",
    "TopologyError",
    "LaunchFailed",
    "load_topology",
    "make_certificates",
    "coordinator_argv",
    "region_argv",
    "client_argv",
    "Launcher",
    "add_parser",
    "command",
    "FEDGRID",
]


class LaunchFailed(FedgridError):
    """A process of the topology failed, or did not start or finish in time (the message names it and its log)."""


#: How each process is started: this interpreter, so a virtual environment's fedgrid runs.
FEDGRID = (sys.executable, "-m", "fedgrid.cli")
#: How often the launcher looks at its processes and the global metrics.
POLL_S = 0.1


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
        #: Global rounds printed so far.
        self.rounds_done = 0
        # The in-place progress line inside a global round (a terminal only: ``bar``).
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._began = self._round_began = time.monotonic()
        self._bar_shown = False

    def say(self, line: str) -> None:
        if self._bar_shown:  # the in-place line goes; the status line takes its place
            self.stream.write("\r\033[K")
            self._bar_shown = False
        print(f"fedgrid launch: {line}", file=self.stream, flush=True)

    def bar(self, now: float) -> None:
        """On a terminal, rewrites one line in place: the global round running, its time so far
        and, after the first round, about how long the run has left (the mean round time)."""
        if not self.tty or self.rounds_done >= self.top.rounds:
            return
        so_far = now - self._round_began
        left = ""
        if self.rounds_done:
            mean = (self._round_began - self._began) / self.rounds_done
            left = f", about {_hms(max(0.0, mean * (self.top.rounds - self.rounds_done) - so_far))} left"
        self.stream.write(
            f"\rfedgrid launch: global round {self.rounds_done + 1}/{self.top.rounds} running for {_hms(so_far)}{left}\033[K"
        )
        self.stream.flush()
        self._bar_shown = True

    def run(self) -> int:
        """Starts the topology and waits for the global run to finish.

        Returns:
            0: the run finished and every process exited 0; 128 + N: stopped by signal N.
        Raises:
            LaunchFailed: a process failed, did not start or did not finish (named; the others stopped).
        """
        if self.out.exists() and any(self.out.iterdir()):
            raise LaunchFailed(
                f"{self.out} is not empty: give a new --out (the state directories in it would resume "
                "the run that is there)"
            )

        def on_signal(name: str) -> None:
            self._signal = name
            self._stop.set()

        with GracefulStop(on_signal, what="launch"):
            try:
                self._start()
                self._watch()
            except _Stopped:
                stopped, killed = self._stop_all()
                say(
                    f"fedgrid launch: {self._signal}: stopped {stopped} processes"
                    + (f" ({killed} killed after {LAUNCH_STOP_GRACE_S:g}s)" if killed else "")
                    + f"; run directories under {self.out}",
                    stream=self.stream,
                )
                return 128 + int(getattr(signal, self._signal or "SIGTERM"))
            except BaseException:
                self._stop_all()
                raise
        self.say(
            f"run finished: {self.rounds_done} global rounds; model {self.out / 'global' / 'model.safetensors'}; "
            f"run directories under {self.out}"
        )
        return 0

    def _spawn(self, name: str, argv: Sequence[str], log: Path) -> _Process:
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log, "wb") as sink:
            popen = subprocess.Popen(
                [*FEDGRID, *argv],
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=functools.partial(_session_of_its_own, os.getpid()),
            )  # the launcher runs no other thread
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
                raise LaunchFailed(
                    f"{process.name} exited before it listened: {_last_line(process.log)} (log {process.log})"
                )
            return False

        try:
            self._wait(listening, timeout=LAUNCH_START_TIMEOUT_S, what=f"{process.name}'s address")
        except _TimedOut:
            raise LaunchFailed(
                f"{process.name} wrote no address to {path} within {LAUNCH_START_TIMEOUT_S:g}s "
                f"(FEDGRID_LAUNCH_START_TIMEOUT_S); its log {process.log} ends: {_last_line(process.log)}"
            ) from None
        return path.read_text().strip()

    def _start(self) -> None:
        top, out = self.top, self.out
        ids = make_certificates(out / "certs", top)
        if self._stop.is_set():
            raise _Stopped
        run_dir = out / "global"
        coordinator = self._spawn(
            "coordinator",
            coordinator_argv(
                top,
                listen="127.0.0.1:0",
                out=str(run_dir),
                state_dir=str(run_dir / "state"),
                tls=ids["global"],
            ),
            run_dir / "coordinator.log",
        )
        address = self._address(coordinator, run_dir)
        self.say(
            f"coordinator on {address}: {top.rounds} global rounds, {len(top.regions)} regions (run directory {run_dir})"
        )
        started = []
        for region in top.regions:  # all regions start at once: each takes seconds to import torch
            region_dir = out / region.name
            argv = region_argv(
                top,
                region,
                upstream=address,
                listen="127.0.0.1:0",
                out=str(region_dir),
                state_dir=str(region_dir / "state"),
                tls=ids[f"{region.name}-lan"],
                upstream_tls=ids[region.name],
            )
            started.append((region, region_dir, self._spawn(region.name, argv, region_dir / "region.log")))
        for region, region_dir, process in started:
            region_address = self._address(process, region_dir)
            for p in region.partitions:
                self._spawn(
                    f"client-{p}",
                    client_argv(
                        top,
                        p,
                        coordinator=region_address,
                        state_dir=str(region_dir / "client-state"),
                        tls=ids[f"client-{p}"],
                    ),
                    region_dir / f"client-{p}.log",
                )
            self.say(
                f"region {region.name} on {region_address}: {len(region.partitions)} client{'s' if len(region.partitions) > 1 else ''} (partitions "
                f"{', '.join(map(str, region.partitions))} of {top.num_partitions}), run directory {region_dir}"
            )

    def _check_exits(self) -> None:
        for process in self.processes:
            status = process.popen.poll()
            if status not in (None, 0):
                raise LaunchFailed(
                    f"{process.name} {_status(status)}: {_last_line(process.log)} (log {process.log})"
                )

    def _watch(self) -> None:
        coordinator = self.processes[0]
        self._began = self._round_began = time.monotonic()  # the topology is up: round 1 runs

        def finished() -> bool:
            self._print_rounds()
            self.bar(time.monotonic())
            return coordinator.popen.poll() == 0

        self._wait(
            finished, timeout=float("inf"), what="the global run"
        )  # the coordinator's own deadlines bound it
        self._print_rounds(final=True)
        finish = 2 * FINISH_GRACE_S + LAUNCH_STOP_GRACE_S  # a region tells its clients, then finishes itself
        try:
            self._wait(
                lambda: all(p.popen.poll() is not None for p in self.processes),
                timeout=finish,
                what="the regions and clients to finish",
            )
        except _TimedOut:
            running = [p.name for p in self.processes if p.popen.poll() is None]
            raise LaunchFailed(
                f"the global run finished but {', '.join(running)} did not exit within {finish:g}s"
            ) from None

    def _print_rounds(self, *, final: bool = False) -> None:
        """Prints a status line for each global round ``global/metrics.jsonl`` gained since the last
        look. Rounds are counted in lines, not bytes: a round's row is rewritten, longer, when its
        server-side evaluation lands (``fedgrid.server.evaluation``); so the newest row waits for
        its accuracy, or for the next round's row, or the run's end (``final``)."""
        path = self.out / "global" / "metrics.jsonl"
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            return
        complete = text[: text.rfind(b"\n") + 1]  # a line still being written waits for the next look
        rows = [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
        ready = len(rows) if final or (rows and rows[-1].get("accuracy") is not None) else len(rows) - 1
        for row in rows[self.rounds_done : ready]:
            self.rounds_done += 1
            self._round_began = time.monotonic()
            self.say(round_line(row, rounds=self.top.rounds, regions=[r.name for r in self.top.regions]))

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


def _hms(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def round_line(row: Mapping[str, Any], *, rounds: int, regions: Sequence[str]) -> str:
    """The status line of one global round (a ``metrics.jsonl`` row): loss, accuracy, regions, WAN bytes per region."""

    def number(key: str) -> str:
        value = row.get(key)
        return f"{value:.4f}" if isinstance(value, (int, float)) else "-"

    per_region = ", ".join(
        f"{name} {_size(row.get(f'bytes_up.{name}', 0))}/{_size(row.get(f'bytes_down.{name}', 0))}"
        for name in regions
    )
    return (
        f"global round {row['round']}/{rounds}: loss {number('loss')}, accuracy {number('accuracy')}; regions "
        f"{row['clients_ok']} ok, {row['clients_failed']} failed; WAN {_size(row['bytes_up'])} up, {_size(row['bytes_down'])} down "
        f"(up/down: {per_region}); {float(row['wall_s']):.2f}s"
    )


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds ``launch`` to the ``fedgrid`` subcommands (``sub``: argparse's subparsers)."""
    parser = sub.add_parser(
        "launch",
        help="run a multi-region topology (docker/topology.toml) as local processes over mutual TLS, "
        "or write it as Kubernetes manifests (--emit k8s)",
    )
    parser.add_argument(
        "topology",
        metavar="TOPOLOGY.toml",
        help="the topology: [global], [clients], [[regions]] (see docker/topology.toml)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        metavar="N",
        help="global rounds (default: the file's [global] rounds)",
    )
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="where certificates, run directories and logs go (empty or new; default runs/launch-TIME); "
        "with --emit, where the manifests go (empty or new; required)",
    )
    parser.add_argument(
        "--emit",
        choices=["k8s"],
        default=None,
        help="write the topology as Kubernetes manifests into --out DIR instead of running it: a "
        "StatefulSet, Deployments, Jobs, Services, a NetworkPolicy, and secrets.sh for the Secrets "
        "(`kubectl apply -f DIR`; docs/multisite.rst)",
    )
    parser.add_argument(
        "--image",
        default=None,
        metavar="IMAGE",
        help="with --emit k8s: the image every pod runs (docker/Dockerfile's, where the cluster pulls "
        "from; default fedgrid:latest)",
    )
    return parser


def command(args: argparse.Namespace) -> int:
    """``fedgrid launch``: a bad topology exits 2 naming the key; a failed process 1; a signal 128 + N."""
    top = load_topology(args.topology, rounds=args.rounds)
    if args.emit is not None:
        return _emit(top, args)
    if args.image is not None:
        raise ConfigError("image", "goes with --emit k8s (a launch runs this machine's fedgrid)")
    out = Path(args.out or f"runs/launch-{time.strftime('%Y%m%d-%H%M%S')}")
    return Launcher(top, out).run()


def _emit(top: Topology, args: argparse.Namespace) -> int:
    """``--emit k8s``: the manifests into ``--out``, one line naming them and what to run next."""
    from fedgrid.ops.k8s import emit  # PyYAML (the k8s extra) only for this

    if not args.out:
        raise ConfigError("out", "--emit k8s writes into --out DIR: give a new or empty directory")
    out = Path(args.out)
    written = emit(top, out, image=args.image or "fedgrid:latest")
    print(
        f"fedgrid launch: {len(written) - 1} manifests and secrets.sh in {out}: make the Secrets "
        f"(PKI=DIR sh {out / 'secrets.sh'}), then kubectl apply -f {out}",
        flush=True,
    )
    return 0
