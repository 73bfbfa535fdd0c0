"""A federation across a lab of real hosts and links (``fedgrid.ops.lab``): a global coordinator,
two regions and four clients, each in its own network namespace with its own address, under
mutual TLS with certificates that name those addresses.

The links: each region reaches the global host over a WAN link of 20 Mbit/s each way with 0.5%
of packets lost (the kernel's ``tbf`` and iptables), plus 10 ms each way from ``fedgrid wan``
inside the global host (this kernel has no netem); each client reaches its region over an
unshaped LAN link. The processes, flags and certificates are ``fedgrid launch``'s
(``fedgrid.ops.topology``): only the addresses differ. So the reference is the same topology
run by ``fedgrid launch`` on loopback, and the lab's runs must end on its model bit for bit.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cryptography import x509

from fedgrid.events import read_events
from fedgrid.ops.lab import Host, Lab, Link, unavailable
from fedgrid.ops.topology import client_argv, coordinator_argv, load_topology, make_certificates, region_argv
from fedgrid.runlog import read_metrics

from harness import FEDGRID, assert_same_model, child_env, wait_until

pytestmark = [
    pytest.mark.skipif(unavailable() is not None, reason=f"no lab: {unavailable()}"),
    # Under pytest-xdist, both tests on one worker: the loopback reference is made once.
    pytest.mark.xdist_group("lab-federation"),
]

ROUNDS, REGIONAL_ROUNDS = 3, 2
#: The global heartbeat: a region silent for 3 of these is dropped, so a 30 s partition (and the
#: tens of seconds TCP's backed-off retransmissions take to notice the link is back) stays under it.
HEARTBEAT_S = 30
TOPOLOGY = f"""
[global]
rounds = {ROUNDS}
seed = 5
min_clients = 2
region_codecs = "region-a=int8,region-b=int8"
heartbeat_interval_s = {HEARTBEAT_S}
threads = 1

[clients]
num_partitions = 4
threads = 1

[[regions]]
name = "region-a"
regional_rounds = {REGIONAL_ROUNDS}
codec = "bf16"
partitions = [0, 1]
threads = 1

[[regions]]
name = "region-b"
regional_rounds = {REGIONAL_ROUNDS}
codec = "bf16"
partitions = [2, 3]
threads = 1
"""
WAN = {"rate_mbit": 20.0, "loss": 0.005}
WAN_DELAY_MS = 10.0
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def topology_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("topology") / "lab.toml"
    path.write_text(TOPOLOGY)
    return path


@pytest.fixture(scope="module")
def loopback(topology_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same topology on loopback: ``fedgrid launch``'s run directory of the global coordinator."""
    out = tmp_path_factory.mktemp("loopback") / "run"
    done = subprocess.run(
        [*FEDGRID, "launch", str(topology_file), "--out", str(out)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out / "global"


@dataclass
class Federation:
    """The topology's processes on the lab's hosts."""

    out: Path
    hosts: dict[str, Host]
    wan: dict[str, Link]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, argv: list[str]) -> None:
        log = open(self.out / f"{name}.log", "w")
        self.procs[name] = self.hosts[name].popen(
            [*FEDGRID, *argv], stdout=log, stderr=subprocess.STDOUT, env=child_env()
        )

    def address(self, name: str, run_dir: Path) -> str:
        path, proc = run_dir / "address", self.procs[name]
        wait_until(
            lambda: path.exists() and path.read_text().strip() != "" or proc.poll() is not None,
            timeout=120,
            what=f"{name}'s address",
        )
        assert proc.poll() is None, (self.out / f"{name}.log").read_text()[-3000:]
        return path.read_text().strip()

    def wait(self) -> None:
        """Every process exits 0 (the coordinator first); else the logs' tails say why."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for name, proc in self.procs.items():
            try:
                status = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                status = None
            assert status == 0, {n: (self.out / f"{n}.log").read_text()[-2000:] for n in self.procs}


def start_federation(lab: Lab, topology_file: Path, out: Path) -> Federation:
    """The topology across ``lab``: a host per process, a shaped WAN link from each region to the
    global host (with a relay there for delay), a LAN link from each client to its region."""
    top = load_topology(topology_file)
    names = [
        "global",
        *(r.name for r in top.regions),
        *(f"client-{p}" for r in top.regions for p in r.partitions),
    ]
    hosts = {name: lab.host(name) for name in names}
    wan = {
        r.name: lab.link(hosts["global"], hosts[r.name], name=f"wan-{r.name[-1]}", **WAN) for r in top.regions
    }
    for r in top.regions:
        for p in r.partitions:
            lab.link(hosts[r.name], hosts[f"client-{p}"], name=f"lan-{p}")
    ids = make_certificates(
        out / "certs",
        top,
        sans={
            "global": [hosts["global"].address],
            **{f"{r.name}-lan": [hosts[r.name].address] for r in top.regions},
        },
    )
    fed = Federation(out, hosts, wan)
    top_dir = out / "global"
    fed.start(
        "global",
        coordinator_argv(
            top,
            listen=f"{hosts['global'].address}:0",
            out=str(top_dir),
            state_dir=str(top_dir / "state"),
            tls=ids["global"],
        ),
    )
    address = fed.address("global", top_dir)
    for i, r in enumerate(top.regions):
        relay = hosts["global"].relay(address, delay_ms=WAN_DELAY_MS, seed=i, name=r.name)
        region_dir = out / r.name
        fed.start(
            r.name,
            region_argv(
                top,
                r,
                upstream=relay.address,
                listen=f"{hosts[r.name].address}:0",
                out=str(region_dir),
                state_dir=str(region_dir / "state"),
                tls=ids[f"{r.name}-lan"],
                upstream_tls=ids[r.name],
            ),
        )
    for r in top.regions:
        region_address = fed.address(r.name, out / r.name)
        for p in r.partitions:
            fed.start(
                f"client-{p}",
                client_argv(
                    top,
                    p,
                    coordinator=region_address,
                    state_dir=str(out / r.name / "client-state"),
                    tls=ids[f"client-{p}"],
                ),
            )
    return fed


def assert_each_round_once(run_dir: Path, regions: tuple[str, ...]) -> None:
    """Every global round opened, closed with both regions and was committed once; no region was dropped."""
    events = read_events(run_dir / "events.jsonl")
    for name in ("round_opened", "round_committed"):
        assert [e["round"] for e in events if e.event == name] == list(range(1, ROUNDS + 1)), name
    closed = [e for e in events if e.event == "round_closed"]
    assert [(e["round"], e["reason"], e["results"], e["failures"]) for e in closed] == [
        (r, "all", 2, 0) for r in range(1, ROUNDS + 1)
    ]
    assert [e for e in events if e.event in ("client_dropped", "round_failed")] == []
    metrics = read_metrics(run_dir)
    assert [(m["round"], m["clients_ok"], m["clients_failed"]) for m in metrics] == [
        (r, 2, 0) for r in range(1, ROUNDS + 1)
    ]
    for region in regions:  # each region's regional rounds: H a global round, each once
        lan = read_metrics(run_dir.parent / region)
        assert [m["round"] for m in lan] == list(range(1, ROUNDS * REGIONAL_ROUNDS + 1)), region
        assert all(m["clients_ok"] == 2 for m in lan), region


def test_a_federation_across_real_hosts_under_mutual_tls_ends_on_the_loopback_model(
    topology_file: Path, loopback: Path, tmp_path: Path
) -> None:
    with Lab() as lab:
        fed = start_federation(lab, topology_file, tmp_path)
        fed.wait()
        counters = {name: link.counters() for name, link in fed.wan.items()}
    assert_same_model(tmp_path / "global", loopback)
    assert_each_round_once(tmp_path / "global", ("region-a", "region-b"))
    # The models crossed the shaped links: each round, the global model down to each region and
    # its int8 update up (a quarter of it), plus TLS and gRPC framing.
    model_bytes = (tmp_path / "global" / "model.safetensors").stat().st_size
    for name, sent in counters.items():
        assert sent[f"global_to_{name}_bytes"] > ROUNDS * model_bytes
        assert sent[f"{name}_to_global_bytes"] > ROUNDS * model_bytes / 4
    # The servers' certificates name their lab addresses, and nothing else: TLS verified those.
    for server, host in (("global", "global"), ("region-a-lan", "region-a"), ("region-b-lan", "region-b")):
        cert = x509.load_pem_x509_certificate((tmp_path / "certs" / f"{server}.pem").read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == [fed.hosts[host].address]
        assert sans.get_values_for_type(x509.DNSName) == []


def test_a_region_partitioned_for_30_s_rejoins_and_the_run_ends_on_the_loopback_model(
    topology_file: Path, loopback: Path, tmp_path: Path
) -> None:
    """region-b's WAN link drops every packet for 30 s from the end of global round 1 (region-b
    is downloading or training round 2, then uploads into the outage): its connections see
    silence, as across a real outage, and carry on once the link is back."""
    with Lab() as lab:
        fed = start_federation(lab, topology_file, tmp_path)
        metrics = tmp_path / "global" / "metrics.jsonl"
        wait_until(
            lambda: (
                metrics.exists()
                and len(read_metrics(tmp_path / "global")) >= 1
                or fed.procs["global"].poll() is not None
            ),
            timeout=RUN_TIMEOUT_S,
            what="global round 1",
        )
        link = fed.wan["region-b"]
        link.cut("blackhole")
        cut = time.time()  # the events' clock
        try:
            time.sleep(30.0)  # the outage's length is the fault itself, not a wait for something
        finally:
            healed = time.time()
            link.heal()
        fed.wait()
    assert_same_model(tmp_path / "global", loopback)
    assert_each_round_once(tmp_path / "global", ("region-a", "region-b"))
    # A round was open across the whole outage (region-b's part of it could not arrive), so the
    # partition hit the run: round 2 here, or round 3 had region-b finished round 2 before the cut.
    events = read_events(tmp_path / "global" / "events.jsonl")
    spans = {
        e["round"]: [e.t, next(c.t for c in events if c.event == "round_closed" and c["round"] == e["round"])]
        for e in events
        if e.event == "round_opened"
    }
    assert any(opened < cut and closed > healed for opened, closed in spans.values()), (cut, healed, spans)
