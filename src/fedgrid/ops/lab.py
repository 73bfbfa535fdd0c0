"""A lab of real hosts and links on one Linux machine: network namespaces joined by veth pairs,
shaped by the kernel (``tc``'s ``tbf`` for rate, iptables' ``statistic`` match for loss), with
``fedgrid wan``'s relay for delay and jitter and partitions that cut a link for a while.

Why: every other multi-host test and benchmark runs on 127.0.0.1 behind ``fedgrid wan``, a relay
of our own. Here the traffic crosses a real network stack: each host has its own address (a
certificate names it), its own routes and firewall, and a link's rate and loss are the kernel's.
It needs root (CAP_NET_ADMIN) and iptables (Debian: ``apt-get install iptables``); without them
``unavailable()`` says why, and ``fedgrid wan`` still emulates a link for anyone.

The model:

- **Host** (``Lab.host``): a network namespace with its loopback up and one address of the lab's
  subnet (``10.77.0.0/16`` by default), on ``lo`` and on each of its links, and its name in its
  ``/etc/hosts`` (``ip netns exec`` shows ``/etc/netns/NS/hosts`` as ``/etc/hosts``), so a process
  inside reaches a neighbour by name or address. ``Host.popen`` runs a process inside it.
- **Link** (``Lab.link``): a veth pair between two hosts, point to point (each end's address
  with the other as its peer), so a host reaches its neighbours and nothing else: there is no
  forwarding, and nothing of the lab is reachable from the machine or the other way. Each end
  sends one packet per segment (``gso_max_segs 1``), so the kernel shapes and drops real packets,
  not 64 KiB offload batches. ``rate_mbit`` puts a ``tbf`` on each end's egress (both directions
  at that rate, a queue of ``QUEUE_S`` of it); ``loss`` drops each packet arriving at either end
  with that probability. The rate counts whole frames (headers too), as a real link does: a TCP
  transfer gets about 1448/1514 = 96% of it as payload.
- **Delay** (``Host.relay``): this kernel has no ``netem`` (DESIGN.md, section 5), so delay and
  jitter come from ``fedgrid wan`` run inside a host: it listens on the host's address and
  forwards to a target, adding its delay to every connection that dials it. Put it at the end of
  a link that accepts the connections (a server's host, or a gateway host between sites).
- **Partition** (``Link.cut`` / ``Link.heal`` / ``Link.partition``): ``blackhole`` drops every
  packet arriving at either end (iptables), so connections stay open and see silence, as across
  a real WAN outage; ``down`` sets both ends down, so each host sees its link gone and a send
  fails at once. ``heal`` restores the link as it was (its shaping, routes and loss).

A lab tears itself down completely on ``close`` (a context manager; also when its body fails):
the processes it started, anything else left in its namespaces, the namespaces (with their
links, queues and rules) and its files. Its names hold its process id and a random token, so
labs run in parallel never collide; a lab whose process died (SIGKILL) is swept by the next one.
A link name or shaping setting that ``ip``, ``tc`` or iptables refuses raises ``LabError``
naming it and the tool's words, and leaves nothing of that link behind.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import math
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Iterator, Mapping, Sequence

from fedgrid.errors import FedgridError

__all__ = [
    "Lab",
    "Host",
    "Link",
    "Relay",
    "LabError",
    "unavailable",
    "open_sink",
    "send",
    "transfer_s",
    "PARTITION_MODES",
    "QUEUE_S",
    "COMMAND_TIMEOUT_S",
]

#: Every lab's namespaces are named ``fglab<pid>x<token>-<host>``.
PREFIX = "fglab"
_NAME = re.compile(rf"^{PREFIX}(\d+)x([0-9a-f]+)-")
#: A host's name: a DNS label (it goes in /etc/hosts and in the namespace's name).
_HOST = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
#: Characters iptables reads as a pattern in an interface name (``eth+`` is every ``eth*``), so a
#: link named with them would shape or cut other links; the kernel accepts them, the lab does not.
_WILDCARDS = frozenset("+!")
PARTITION_MODES = ("blackhole", "down")
#: A ``tbf`` queue holds this long at its rate (64 KiB at least): enough that TCP keeps the link
#: busy at its few-millisecond RTT here, little enough that a queue adds no WAN-sized delay.
QUEUE_S = 0.05
#: The deadline of each ``ip``, ``tc`` and ``iptables`` command, and of a relay's start.
COMMAND_TIMEOUT_S = 30.0
#: How long ``close`` waits for a process it sent SIGTERM before it sends SIGKILL.
STOP_GRACE_S = 5.0
ETC_NETNS = Path("/etc/netns")


class LabError(FedgridError):
    """A lab that cannot be made as asked: the message names the host, link or setting and what refused it."""


def _run(argv: Sequence[str], *, what: str, timeout: float = COMMAND_TIMEOUT_S) -> str:
    """Runs a tool; its refusal becomes a ``LabError`` that starts with ``what`` and quotes the tool."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise LabError(f"{what}: {argv[0]} is not installed") from None
    except subprocess.TimeoutExpired:
        raise LabError(f"{what}: `{' '.join(argv)}` did not finish within {timeout:g}s") from None
    if done.returncode != 0:
        words = " ".join((done.stderr or done.stdout).split())
        tool = argv[4] if list(argv[:3]) == ["ip", "netns", "exec"] else argv[0]  # the tool run inside a host
        raise LabError(f"{what}: {Path(tool).name} refused it ({words})")
    return done.stdout


@functools.cache
def unavailable() -> str | None:
    """Why no lab can be made on this machine (``None``: it can). Probed once: a namespace with a
    ``tbf`` queue and a ``statistic`` rule is made and removed."""
    if not sys.platform.startswith("linux"):
        return "the lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return (
            "the lab needs root (network namespaces, tc and iptables need CAP_NET_ADMIN); "
            "`fedgrid wan` emulates a link without it"
        )
    missing = [tool for tool in ("ip", "tc", "iptables") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (Debian: apt-get install iproute2 iptables)"
    probe = f"{PREFIX}{os.getpid()}x0-probe"
    try:
        _run(["ip", "netns", "add", probe], what="a network namespace")
        _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", *_tbf(10.0)], what="tc's tbf")
        _run(
            ["ip", "netns", "exec", probe, "iptables", "-w", "5", "-A", "INPUT", *_loss_match("lo", 0.5)],
            what="iptables' statistic match",
        )
    except LabError as exc:
        return str(exc)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _tbf(rate_mbit: float) -> list[str]:
    """``tbf``'s arguments for ``rate_mbit``: a burst of 2 ms at the rate (two frames at least),
    a queue of ``QUEUE_S``."""
    bytes_per_s = rate_mbit * 1e6 / 8
    burst = max(3028, int(bytes_per_s * 0.002))
    limit = max(65536, int(bytes_per_s * QUEUE_S), 2 * burst)
    # tc reads a bare rate in bytes per second, so the rate goes as bits to say which.
    return ["rate", f"{round(rate_mbit * 1e6)}bit", "burst", str(burst), "limit", str(limit)]


def _loss_match(interface: str, probability: float) -> list[str]:
    return [
        "-i",
        interface,
        "-m",
        "statistic",
        "--mode",
        "random",
        "--probability",
        repr(probability),
        "-j",
        "DROP",
    ]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop(proc: subprocess.Popen[Any], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; waits for the process either way."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=COMMAND_TIMEOUT_S)


def _remove_namespace(netns: str) -> list[str]:
    """Kills what runs in ``netns`` (by process id: a namespace of ours holds only our processes),
    deletes it and its /etc/netns folder; returns what could not be done."""
    problems = []
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, check=False).stdout
    for pid in (int(p) for p in pids.split()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    done = subprocess.run(["ip", "netns", "del", netns], capture_output=True, text=True, check=False)
    if done.returncode != 0 and netns in _namespaces():
        problems.append(f"namespace {netns}: {done.stderr.strip()}")
    shutil.rmtree(ETC_NETNS / netns, ignore_errors=True)
    return problems


def _namespaces() -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def sweep() -> list[str]:
    """Removes the namespaces of labs whose process is gone (a SIGKILLed test); returns their names."""
    stale = [n for n in _namespaces() if (m := _NAME.match(n)) and not _alive(int(m.group(1)))]
    for netns in stale:
        _remove_namespace(netns)
    if ETC_NETNS.is_dir():
        for folder in ETC_NETNS.iterdir():
            if (m := _NAME.match(folder.name)) and not _alive(int(m.group(1))):
                shutil.rmtree(folder, ignore_errors=True)
    return stale


@dataclass
class Host:
    """A host of the lab: a network namespace with one address (``Lab.host`` makes it)."""

    lab: "Lab"
    name: str
    address: str
    netns: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> "subprocess.Popen[Any]":
        """Starts ``argv`` inside this host (``subprocess.Popen``'s keyword arguments); the lab
        stops it on ``close`` if it still runs."""
        proc = subprocess.Popen(self.command(argv), **kwargs)
        self.lab._processes.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout: float = COMMAND_TIMEOUT_S) -> str:
        """Runs ``argv`` inside this host to completion; returns its output.

        Raises:
            LabError: it failed or outlived ``timeout`` (its error output in the message).
        """
        return _run(self.command(argv), what=f"host {self.name}: {' '.join(argv)}", timeout=timeout)

    def relay(
        self,
        target: str,
        *,
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        rate_mbit: float | None = None,
        loss: float = 0.0,
        seed: int = 0,
        name: str = "",
    ) -> "Relay":
        """Starts ``fedgrid wan`` inside this host, on its address and a free port, relaying to
        ``target`` (``HOST:PORT``, reachable from here) with that link model (``WanLink``).

        Returns:
            The relay: dial ``relay.address`` instead of ``target``.
        Raises:
            LabError: the relay refused its flags or wrote no address within ``COMMAND_TIMEOUT_S``.
        """
        label = name or "wan"
        stem = f"{self.name}.{label}.{len(self.lab._relays)}"  # one per relay
        address_file, log = self.lab.workdir / f"{stem}.address", self.lab.workdir / f"{stem}.log"
        flags = [
            *("--listen", f"{self.address}:0", "--target", target, "--address-file", str(address_file)),
            *("--delay-ms", repr(delay_ms), "--jitter-ms", repr(jitter_ms), "--loss", repr(loss)),
            *("--seed", str(seed), *(["--rate-mbit", repr(rate_mbit)] if rate_mbit is not None else [])),
        ]
        with open(log, "wb") as sink:
            proc = self.popen([sys.executable, "-m", "fedgrid.cli", "wan", *flags], stdout=sink, stderr=sink)
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while not (address_file.exists() and address_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                _stop(proc)
                raise LabError(
                    f"host {self.name}: relay {label} to {target} did not start: {log.read_text()[-800:]}"
                )
            time.sleep(0.02)
        relay = Relay(self, label, address_file.read_text().strip(), target, proc, log)
        self.lab._relays.append(relay)
        return relay


@dataclass
class Relay:
    """``fedgrid wan`` running inside a host (``Host.relay``)."""

    host: Host
    name: str
    address: str
    target: str
    proc: "subprocess.Popen[Any]" = field(repr=False)
    log: Path

    def stop(self) -> str:
        """Stops the relay (SIGTERM: it reports what it carried); returns its closing line."""
        _stop(self.proc)
        lines = self.log.read_text().splitlines()
        return lines[-1] if lines else ""


@dataclass
class Link:
    """A veth pair between two hosts (``Lab.link`` makes it); the interface at each end has the link's name."""

    lab: "Lab"
    name: str
    a: Host
    b: Host
    rate_mbit: float | None
    loss: float
    cut_mode: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _ends(self) -> tuple[Host, Host]:
        return self.a, self.b

    def counters(self) -> dict[str, int]:
        """Bytes and packets each end has sent into the link (``a_to_b_bytes``, ...), frames whole."""
        out = {}
        for src, dst in ((self.a, self.b), (self.b, self.a)):
            stats = json.loads(
                _run(
                    ["ip", "-n", src.netns, "-j", "-s", "link", "show", "dev", self.name],
                    what=f"link {self.name}",
                )
            )
            tx = stats[0]["stats64"]["tx"]
            out[f"{src.name}_to_{dst.name}_bytes"] = int(tx["bytes"])
            out[f"{src.name}_to_{dst.name}_packets"] = int(tx["packets"])
        return out

    def dropped(self) -> dict[str, int]:
        """Packets the link's ``loss`` dropped so far, by direction (``a_to_b``, ...): the
        counters of each end's iptables rule (a partition's drops are not counted)."""
        out = {}
        for src, dst in ((self.b, self.a), (self.a, self.b)):
            rows = dst.run(["iptables", "-w", "5", "-v", "-x", "-n", "-L", "INPUT"]).splitlines()[2:]
            out[f"{src.name}_to_{dst.name}"] = sum(
                int(row.split()[0])
                for row in rows
                if "statistic" in row and row.split()[2] == "DROP" and row.split()[5] == self.name
            )
        return out

    def cut(self, mode: str = "blackhole") -> None:
        """Partitions the link until ``heal``: ``blackhole`` drops every packet arriving at
        either end (connections see silence), ``down`` sets both ends down (sends fail at once).

        Raises:
            LabError: an unknown mode, or the link is cut already.
        """
        if mode not in PARTITION_MODES:
            raise LabError(
                f"link {self.name}: partition mode {mode!r} is not one of {', '.join(PARTITION_MODES)}"
            )
        with self._lock:
            if self.cut_mode is not None:
                raise LabError(f"link {self.name} is cut already ({self.cut_mode})")
            for end in self._ends():
                if mode == "blackhole":
                    end.run(["iptables", "-w", "5", "-I", "INPUT", "1", "-i", self.name, "-j", "DROP"])
                else:
                    _run(["ip", "-n", end.netns, "link", "set", self.name, "down"], what=f"link {self.name}")
            self.cut_mode = mode

    def heal(self) -> None:
        """Ends a partition (``cut``): the link carries traffic again, shaped as before. A link
        that is not cut is left as it is."""
        with self._lock:
            if self.cut_mode is None:
                return
            for end in self._ends():
                if self.cut_mode == "blackhole":
                    end.run(["iptables", "-w", "5", "-D", "INPUT", "-i", self.name, "-j", "DROP"])
                else:
                    _run(["ip", "-n", end.netns, "link", "set", self.name, "up"], what=f"link {self.name}")
            self.cut_mode = None

    def partition(self, seconds: float, mode: str = "blackhole") -> None:
        """Cuts the link for ``seconds`` (blocking), then heals it, also if the wait is interrupted."""
        self.cut(mode)
        try:
            time.sleep(seconds)  # the outage's length is the fault itself, not a wait for something
        finally:
            self.heal()


#: The two ends of a measured transfer (``open_sink``, ``send``, ``transfer_s``).
TRANSFER = [sys.executable, "-m", "fedgrid.ops.lab_transfer"]


def open_sink(host: Host, *, timeout: float = COMMAND_TIMEOUT_S) -> tuple["subprocess.Popen[str]", int]:
    """A TCP sink inside ``host`` on a free port, for one connection (``fedgrid.ops.lab_transfer``);
    it gives up after ``timeout`` seconds without one. Returns it and its port.

    Raises:
        LabError: it printed no port within ``timeout``.
    """
    proc = host.popen([*TRANSFER, "sink", repr(timeout)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().strip() if ready else ""
    if not line.isdigit():
        _stop(proc)
        raise LabError(f"host {host.name}: the sink did not start: {line!r}")
    return proc, int(line)


def send(host: Host, target: str, size: int, *, timeout: float = COMMAND_TIMEOUT_S) -> float:
    """Sends ``size`` bytes from ``host`` to a sink at ``target`` (``HOST:PORT``); returns the
    seconds from the connect's start to the sink's reply once it has read them all.

    Raises:
        LabError: the connect or the transfer failed or outlived ``timeout`` (the error's words:
            ``timed out``, ``Network is unreachable``, ...).
    """
    done = subprocess.run(
        host.command([*TRANSFER, "send", target, str(size), repr(timeout)]),
        capture_output=True,
        text=True,
        timeout=timeout + COMMAND_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        words = " ".join((done.stdout + done.stderr).split())
        raise LabError(f"host {host.name}: a transfer of {size} bytes to {target} failed: {words}")
    return float(done.stdout)


def transfer_s(
    src: Host,
    dst: Host,
    size: int,
    *,
    relay: Mapping[str, Any] | None = None,
    timeout: float = COMMAND_TIMEOUT_S,
) -> float:
    """Seconds a ``size``-byte TCP transfer from ``src`` to ``dst`` takes over their link
    (connect to the receiver's reply), directly or through ``fedgrid wan`` inside ``dst`` with
    ``relay`` (``Host.relay``'s keyword arguments).

    Raises:
        LabError: the transfer failed, or the sink did not read ``size`` bytes.
    """
    proc, port = open_sink(dst, timeout=timeout)
    target = f"{dst.name}:{port}"  # by name: the lab's /etc/hosts
    through = dst.relay(f"127.0.0.1:{port}", **relay) if relay is not None else None
    try:
        seconds = send(src, through.address if through else target, size, timeout=timeout)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        _stop(proc)
        if through is not None:
            through.stop()
    if out.split() != [str(size)]:
        raise LabError(f"host {dst.name}: the sink read {out.strip()!r}, not {size} bytes")
    return seconds


class Lab:
    """Hosts and links made on this machine, removed by ``close`` (``with Lab() as lab:``).

    Args:
        subnet: where the hosts' addresses come from, in order (a private range: the lab's
            namespaces are reachable from nothing else, so any range is safe, but a private one
            reads as what it is).
    Raises:
        LabError: ``unavailable()`` names why no lab can be made here.
    """

    def __init__(self, subnet: str = "10.77.0.0/16") -> None:
        reason = unavailable()
        if reason is not None:
            raise LabError(f"no lab on this machine: {reason}")
        sweep()
        self.prefix = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        self._addresses: Iterator[ipaddress.IPv4Address | ipaddress.IPv6Address] = ipaddress.ip_network(
            subnet
        ).hosts()
        self.hosts: dict[str, Host] = {}
        self.links: dict[str, Link] = {}
        self._processes: list[subprocess.Popen[Any]] = []
        self._relays: list[Relay] = []
        self._closed = False

    def __enter__(self) -> "Lab":
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def host(self, name: str) -> Host:
        """A new host ``name`` with the next address of the subnet.

        Raises:
            LabError: ``name`` is not a DNS label of at most 31 characters, or the lab has one.
        """
        if not _HOST.match(name):
            raise LabError(
                f"host name {name!r}: a lower-case letter, then letters, digits or '-', 31 characters at most"
            )
        if name in self.hosts:
            raise LabError(f"host name {name!r}: the lab has a host of that name")
        netns = f"{self.prefix}-{name}"
        address = str(next(self._addresses))
        _run(["ip", "netns", "add", netns], what=f"host {name}")
        host = Host(self, name, address, netns)
        self.hosts[name] = host
        _run(["ip", "-n", netns, "link", "set", "lo", "up"], what=f"host {name}")
        _run(["ip", "-n", netns, "addr", "add", f"{address}/32", "dev", "lo"], what=f"host {name}")
        self._write_hosts_files()
        return host

    def _write_hosts_files(self) -> None:
        names = "".join(f"{h.address}\t{h.name}\n" for h in self.hosts.values())
        for host in self.hosts.values():
            folder = ETC_NETNS / host.netns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(f"127.0.0.1\tlocalhost\n::1\tlocalhost\n{names}")

    def link(
        self,
        a: Host,
        b: Host,
        *,
        name: str = "",
        rate_mbit: float | None = None,
        loss: float = 0.0,
    ) -> Link:
        """A link between hosts ``a`` and ``b``: a veth pair whose ends are both named ``name``.

        Args:
            a, b: two hosts of this lab.
            name: the interfaces' name (default ``lN``): at most 15 characters (``ip`` says so).
            rate_mbit: each direction's rate in Mbit/s (10^6 bit/s), frames whole; ``None``: unshaped.
            loss: the probability that a packet arriving at either end is dropped.
        Returns:
            The link, carrying traffic.
        Raises:
            LabError: the name or a setting was refused (by the lab, ``ip``, ``tc`` or iptables:
                the message names which and why); nothing of the link remains.
        """
        name = name or f"l{len(self.links) + 1}"
        what = f"link {name!r} ({a.name} - {b.name})"
        if a.lab is not self or b.lab is not self or a is b:
            raise LabError(f"{what}: joins two different hosts of this lab")
        if name in self.links or _WILDCARDS & set(name):
            raise LabError(
                f"{what}: the name is taken or holds iptables' wildcards {''.join(sorted(_WILDCARDS))}"
            )
        # Both links' peer routes would name the same address, and the first would carry everything.
        joined = next((n for n, k in self.links.items() if {k.a.name, k.b.name} == {a.name, b.name}), None)
        if joined is not None:
            raise LabError(f"{what}: {a.name} and {b.name} are joined already, by link {joined!r}")
        # tc takes a negative or NaN rate without a word (and shapes to nothing); what tc refuses
        # itself (0) it names below, as iptables names a loss outside [0, 1].
        if rate_mbit is not None and not (math.isfinite(rate_mbit) and rate_mbit >= 0):
            raise LabError(f"{what}: rate_mbit must be a number > 0 or None, not {rate_mbit!r}")
        if not math.isfinite(loss):
            raise LabError(f"{what}: loss must be a probability in [0, 1], not {loss!r}")
        _run(
            [
                "ip",
                "link",
                "add",
                name,
                "netns",
                a.netns,
                "type",
                "veth",
                "peer",
                "name",
                name,
                "netns",
                b.netns,
            ],
            what=f"{what}: the interface name",
        )
        rules: list[tuple[Host, list[str]]] = []
        try:
            for end, peer in ((a, b), (b, a)):
                ip = ["ip", "-n", end.netns]
                _run([*ip, "link", "set", name, "gso_max_segs", "1"], what=what)
                _run(
                    [*ip, "addr", "add", f"{end.address}/32", "peer", f"{peer.address}/32", "dev", name],
                    what=what,
                )
                if rate_mbit is not None:
                    _run(
                        ["tc", "-n", end.netns, "qdisc", "add", "dev", name, "root", "tbf", *_tbf(rate_mbit)],
                        what=f"{what}: rate {rate_mbit:g} Mbit/s",
                    )
                if loss:
                    rule = _loss_match(name, loss)
                    _run(
                        ["ip", "netns", "exec", end.netns, "iptables", "-w", "5", "-A", "INPUT", *rule],
                        what=f"{what}: loss {loss:g}",
                    )
                    rules.append((end, rule))
                _run([*ip, "link", "set", name, "up"], what=what)
        except LabError:
            for end, rule in rules:
                subprocess.run(
                    end.command(["iptables", "-w", "5", "-D", "INPUT", *rule]),
                    capture_output=True,
                    check=False,
                )
            subprocess.run(["ip", "-n", a.netns, "link", "del", name], capture_output=True, check=False)
            raise
        link = Link(self, name, a, b, rate_mbit, loss)
        self.links[name] = link
        return link

    def interfaces(self, host: Host) -> list[str]:
        """The names of ``host``'s interfaces (``lo`` and its links)."""
        listing = json.loads(_run(["ip", "-n", host.netns, "-j", "link", "show"], what=f"host {host.name}"))
        return [entry["ifname"] for entry in listing]

    def close(self) -> None:
        """Stops every process the lab started (SIGTERM, then SIGKILL), kills anything else left in
        its namespaces and removes them with their links, and its files. Safe to call twice.

        Raises:
            LabError: something could not be removed (the rest was).
        """
        if self._closed:
            return
        self._closed = True
        for proc in reversed(self._processes):
            try:
                _stop(proc)
            except (OSError, subprocess.TimeoutExpired):
                pass
        problems = []
        for host in self.hosts.values():
            problems += _remove_namespace(host.netns)
        shutil.rmtree(self.workdir, ignore_errors=True)
        if problems:
            raise LabError(f"the lab {self.prefix} was not removed whole: {'; '.join(problems)}")
