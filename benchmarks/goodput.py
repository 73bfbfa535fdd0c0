"""Goodput across an emulated WAN: synchronous DiLoCo against overlapped streaming DiLoCo and async quorum rounds.

Topology: 2 regions x 2 workers and a coordinator. Each region's workers reach the
coordinator through the region's own emulated link (``fedgrid.ops.wan.WanRelay``: 40 ms each
way, 80 ms RTT, shared by the region's two workers as a site's uplink is). The link's rate is
chosen so that one full sync (every worker of a region uploading and downloading the whole
model) takes about as long as one round of inner steps, measured first (``calibrate``).

Speeds and faults: worker 3 runs at half speed (``goodput_app``: it waits after each step as
long as the step took); worker 1 is killed (SIGKILL) once the run is halfway and restarted
from its client state file (``--state-dir``), as a preempted machine would come back.

Variants, side by side in one run (each in turn, the order rotating per repetition):

- ``sync``: synchronous DiLoCo, today's default: download, H inner steps, upload, wait for
  the round to close.
- ``overlap``: streaming DiLoCo with F fragments, the outer sync overlapped with the next
  inner steps (``--sync-delay-steps tau``, ``--merge-alpha 0.5``). In the faults scenario
  each task is the fast workers' time of H steps (``--inner-time-s``), and rounds close at a
  quorum as ``async``'s do.
- ``async``: streaming DiLoCo with F fragments, overlapped by a whole round of inner steps
  (``--sync-delay-steps H``), whose rounds close at a quorum of 3 of the 4 workers plus a grace
  window, a late result merged into its own fragment in a later round with FedBuff's staleness
  discount (``--min-quorum 3 --grace-s --max-staleness 2``).

Modes: ``real`` trains the model for real (one torch thread a process; on a 2-core machine
the four workers share two cores, so compute itself is slowed by contention, alike for every
variant); ``wait`` replaces each inner step's compute by a calibrated wait of the step time
measured alone (``goodput_app``'s ``GOODPUT_STEP_S``), so four workers "compute" at once.
The ``wait`` rows measure the schedule; the ``real`` rows measure the schedule with real
training, and only they report a meaningful held-out loss.

Reported per variant and mode (medians over ``--repeats``):

- ``utilization``: the sum over workers of compute seconds over the sum of wall seconds
  (each task's split, ``fedgrid.client.timeline``, from the coordinator's per-round sums),
  from round 2 on (round 1's windows hold the workers' start-up, alike for every variant;
  ``utilization_with_start`` in the JSON counts it). Only windows of results the coordinator
  merged count: the killed worker's unfinished task is not in them, its restart's start is;
- ``tokens_per_s``: tokens trained by all workers over the run's wall time;
- ``held_out_loss``: the coordinator's evaluation of the final model (nats per character),
  after the same number of outer rounds, so at (about) equal tokens;
- ``bytes_per_worker_step``: bytes through the links, both ways, per worker per outer step.

Run: ``python benchmarks/goodput.py`` (defaults below; about 15 minutes on 2 cores), or
``--modes wait --variants sync,overlap --repeats 1`` for a quick look. Writes
``benchmarks/results/goodput.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fedgrid.ops.lab import Lab  # noqa: E402
from fedgrid.ops.wan import WanLink, WanRelay  # noqa: E402
from fedgrid.runlog import read_metrics  # noqa: E402

REGIONS, WORKERS_PER_REGION = 2, 2
WORKERS = REGIONS * WORKERS_PER_REGION
SLOW_WORKER, KILLED_WORKER = 3, 1
SEED = 7
FEDGRID = [sys.executable, "-m", "fedgrid.cli"]
VARIANTS = ("sync", "overlap", "async")


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra})
    return env


class Loopback:
    """Every process on this machine's loopback; each region's link is a ``WanRelay`` in this process."""

    listen = "127.0.0.1:0"
    #: Plaintext, as on loopback: on another address the coordinator and its clients each need
    #: --insecure to say so.
    plaintext_flags: list[str] = []

    def __init__(self, link: WanLink) -> None:
        self.link = link
        self.relays: list[WanRelay] = []

    def start(self, name: str, args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(
            [*FEDGRID, *args, "--threads", "1"],
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            env=_env(env),
        )

    def region_link(self, region: int, address: str) -> str:
        """Starts region ``region``'s link to the coordinator at ``address``; returns what its workers dial."""
        relay = WanRelay(
            address, link=WanLink(delay_ms=self.link.delay_ms, rate_mbit=self.link.rate_mbit, seed=region)
        ).start()
        self.relays.append(relay)
        return relay.address

    def link_bytes(self) -> int:
        """Payload bytes through the regions' links, both ways."""
        return sum(r.bytes_up + r.bytes_down for r in self.relays)

    def close(self) -> None:
        for relay in self.relays:
            relay.stop()


class LabLinks(Loopback):
    """``--link lab``: each process on a host of its own (``fedgrid.ops.lab``: network namespaces).
    Each region is a gateway host whose WAN link to the coordinator's host is shaped by the
    kernel (``tbf`` at the link's rate; it counts whole frames, so TCP's payload gets 95.6% of
    it), its workers on unshaped LAN links behind it; the delay comes from ``fedgrid wan`` in the
    gateway, which the workers dial (the kernel here has no netem)."""

    def __init__(self, link: WanLink) -> None:
        super().__init__(link)
        self.lab = Lab()
        try:
            self.hosts = {"coordinator": self.lab.host("coordinator")}
            self.wan = []
            for r in range(REGIONS):
                gateway = self.hosts[f"gateway-{r}"] = self.lab.host(f"gateway-{r}")
                self.wan.append(
                    self.lab.link(
                        self.hosts["coordinator"], gateway, name=f"wan-{r}", rate_mbit=link.rate_mbit
                    )
                )
                for w in range(WORKERS_PER_REGION):
                    i = r * WORKERS_PER_REGION + w
                    self.hosts[f"worker-{i}"] = self.lab.host(f"worker-{i}")
                    self.lab.link(gateway, self.hosts[f"worker-{i}"], name=f"lan-{i}")
        except BaseException:
            self.lab.close()
            raise
        self.listen = f"{self.hosts['coordinator'].address}:0"
        # The lab's hosts are reached from nothing outside it, and the loopback runs are plaintext too.
        self.plaintext_flags = ["--insecure"]

    def start(self, name: str, args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        return self.hosts[name].popen(
            [*FEDGRID, *args, "--threads", "1"],
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            env=_env(env),
        )

    def region_link(self, region: int, address: str) -> str:
        relay = self.hosts[f"gateway-{region}"].relay(address, delay_ms=self.link.delay_ms, seed=region)
        return relay.address

    def link_bytes(self) -> int:
        """Bytes through the regions' WAN links, both ways, whole frames."""
        return sum(v for link in self.wan for k, v in link.counters().items() if k.endswith("_bytes"))

    def close(self) -> None:
        self.lab.close()


def _wait_for(what: str, condition: Any, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def calibrate(args: argparse.Namespace) -> dict[str, float]:
    """The model's size and its inner step time alone (median over ``inner_steps`` steps after a warm-up)."""
    from fedgrid.simulation.tasks import ClientOptions, builtin_client

    torch.set_num_threads(1)
    client = builtin_client(
        0,
        WORKERS,
        SEED,
        options=ClientOptions(
            dataset=args.dataset, data_dir=args.data_dir, model=args.model, batch_size=args.batch
        ),
    )
    model, optimizer = client.model, torch.optim.AdamW(client.model.parameters(), lr=1e-3)
    times = []
    batches = client._batches(epochs=0, steps=args.inner_steps + 5)
    for i, (inputs, targets) in enumerate(batches):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss, _ = client._batch_loss(model, inputs, targets)
        loss.backward()
        optimizer.step()
        if i >= 5:
            times.append(time.perf_counter() - started)
        tokens_per_example = targets[0].numel()
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {
        "step_s": statistics.median(times),
        "state_bytes": state_bytes,
        "tokens_per_example": tokens_per_example,
    }


def _strategy_flags(
    variant: str, scenario: str, cal: dict[str, float], args: argparse.Namespace
) -> list[str]:
    """The coordinator's strategy flags of ``variant`` in ``scenario``."""
    flags = ["--inner-steps", str(args.inner_steps)]
    if variant == "sync":
        return ["--strategy", "diloco", *flags]
    streaming = ["--strategy", "streaming-diloco", "--num-fragments", str(args.fragments)]
    alpha = ["--merge-alpha", str(args.merge_alpha)]
    quorum = ["--min-quorum", str(WORKERS - 1), "--grace-s", str(args.grace_s), "--max-staleness", "2"]
    if variant == "overlap":
        flags = [*streaming, "--sync-delay-steps", str(args.tau), *alpha, *flags]
        if scenario == "faults":
            # Speed-aware local work: every worker runs the fast workers' time of H steps (its
            # lookahead tau/H of it), so the half-speed one arrives with the others (having
            # trained fewer steps, and weighing less); and rounds close at a quorum, so no round
            # waits for the killed worker's restart (its late fragment merges into its own).
            flags += ["--inner-time-s", f"{args.inner_steps * cal['step_s']:.3f}", *quorum]
        return flags
    # async: streaming DiLoCo whose rounds close at a quorum, a late result merged into its own
    # fragment (the one its task synced); overlapped by a whole round of steps, since a round
    # waits for its quorum and grace window as well as for the sync.
    return [*streaming, "--sync-delay-steps", str(args.inner_steps), *alpha, *quorum, *flags]


def run(
    variant: str,
    mode: str,
    scenario: str,
    cal: dict[str, float],
    link: WanLink,
    args: argparse.Namespace,
    work: Path,
) -> dict[str, Any]:
    """One run of ``variant`` in ``mode`` and ``scenario`` over ``args.link``'s links; returns its figures."""
    out = work / f"{variant}-{mode}-{scenario}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    common = [
        "--seed",
        str(SEED),
        "--dataset",
        args.dataset,
        "--round-timeout-s",
        "3600",
        "--heartbeat-interval-s",
        "3",
        # The held-out loss of the final model only: an evaluation between rounds is time every
        # worker waits for (docs/language_models.rst).
        "--eval-every",
        str(args.rounds),
    ]
    if args.data_dir:
        common += ["--data-dir", args.data_dir]
    if args.model:
        common += ["--model", args.model]
    env = {
        "GOODPUT_DATASET": args.dataset,
        "GOODPUT_DATA_DIR": args.data_dir,
        "GOODPUT_MODEL": args.model,
        "GOODPUT_BATCH_SIZE": str(args.batch),
        "GOODPUT_SLOW_PARTITION": str(SLOW_WORKER) if scenario == "faults" else "",
        "GOODPUT_STEP_S": f"{cal['step_s']:.6f}" if mode == "wait" else "0",
    }
    net = LabLinks(link) if args.link == "lab" else Loopback(link)
    try:
        return _run(net, variant, mode, scenario, cal, args, out, common, env)
    finally:
        net.close()


def _run(
    net: Loopback,
    variant: str,
    mode: str,
    scenario: str,
    cal: dict[str, float],
    args: argparse.Namespace,
    out: Path,
    common: list[str],
    env: dict[str, str],
) -> dict[str, Any]:
    rounds = args.rounds  # every round is H inner steps a worker, streaming or not: equal tokens
    coordinator = net.start(
        "coordinator",
        [
            "coordinator",
            "--listen",
            net.listen,
            *net.plaintext_flags,
            "--out",
            str(out / "global"),
            "--rounds",
            str(rounds),
            "--min-clients",
            str(WORKERS),
            *_strategy_flags(variant, scenario, cal, args),
            *common,
        ],
        out / "coordinator.log",
        env,
    )
    procs: dict[str, subprocess.Popen] = {"coordinator": coordinator}
    started = time.monotonic()

    def worker(i: int, target: str) -> subprocess.Popen:
        return net.start(
            f"worker-{i}",
            [
                "client",
                "--coordinator",
                target,
                "--app",
                "goodput_app:client",
                "--partition",
                f"{i}/{WORKERS}",
                "--seed",
                str(SEED),
                "--state-dir",
                str(out / "state"),
                *net.plaintext_flags,
            ],
            out / f"worker-{i}-{time.monotonic_ns()}.log",
            env,
        )

    try:
        address_file = out / "global" / "address"
        _wait_for(
            "the coordinator's address",
            lambda: address_file.exists() and address_file.read_text().strip(),
            coordinator,
            120,
        )
        address = address_file.read_text().strip()
        targets = {}
        for r in range(REGIONS):
            target = net.region_link(r, address)
            for w in range(WORKERS_PER_REGION):
                i = r * WORKERS_PER_REGION + w
                targets[i] = target
                procs[f"worker-{i}"] = worker(i, target)
        if scenario == "faults":
            metrics = out / "global" / "metrics.jsonl"
            half = rounds // 2
            _wait_for(
                f"round {half}",
                lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= half,
                coordinator,
                3600,
            )
            victim = procs[f"worker-{KILLED_WORKER}"]
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            procs[f"worker-{KILLED_WORKER}"] = worker(KILLED_WORKER, targets[KILLED_WORKER])
        # A worker that exits before the coordinator does (a bad flag, a crash) ends the run: its
        # rounds would otherwise wait for it until the round timeout.
        while coordinator.poll() is None:
            dead = [n for n, p in procs.items() if n != "coordinator" and p.poll() not in (None, 0)]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited early; see {out}")
            time.sleep(0.2)
        if coordinator.returncode != 0:
            raise RuntimeError(f"the coordinator exited {coordinator.returncode}; see {out}")
        wall = time.monotonic() - started
        for name, proc in procs.items():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    link_bytes = net.link_bytes()
    rows = read_metrics(out / "global")
    # Steady state: round 1's windows hold each worker's start (imports, data, the join of all
    # four, the first download of the whole model), the same for every variant.
    steady = [r for r in rows if int(r["round"]) > 1]
    compute = sum(float(r.get("compute_s", 0.0)) for r in steady)
    walls = sum(float(r.get("worker_wall_s", 0.0)) for r in steady)
    all_compute = sum(float(r.get("compute_s", 0.0)) for r in rows)
    all_walls = sum(float(r.get("worker_wall_s", 0.0)) for r in rows)
    # A window of the language model is ``context`` characters, each a target once (docs/language_models.rst).
    tokens = sum(float(r.get("examples", 0.0)) for r in rows) * cal["tokens_per_example"]
    evaluated = [r for r in rows if "loss" in r]
    return {
        "variant": variant,
        "mode": mode,
        "rounds": rounds,
        "utilization": compute / walls if walls else 0.0,
        "utilization_with_start": all_compute / all_walls if all_walls else 0.0,
        "late_merged": sum(float(r.get("late_merged", 0.0)) for r in rows),
        "compute_s": compute,
        "worker_wall_s": walls,
        "run_wall_s": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "held_out_loss": float(evaluated[-1]["loss"]) if evaluated else None,
        "bytes_per_worker_step": link_bytes / (WORKERS * rounds),
        "rounds_failed": sum(1 for r in rows if r.get("round_failed")),
        "dir": str(out),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated: sync, overlap, async"
    )
    parser.add_argument("--modes", default="wait,real", help="comma-separated: wait (calibrated), real")
    parser.add_argument(
        "--repeats", type=int, default=2, help="repetitions of each variant and mode (default 2)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=6,
        help="outer rounds of each run, H inner steps a worker each (default 6)",
    )
    parser.add_argument("--inner-steps", type=int, default=100, help="H (default 100)")
    parser.add_argument(
        "--step-s",
        type=float,
        default=0.0,
        help="the inner step's seconds instead of the one measured (0: measured): compares runs of "
        "different code at one calibration, the link's rate and wait mode's steps alike",
    )
    parser.add_argument("--fragments", type=int, default=2, help="F of the streaming variants (default 2)")
    parser.add_argument(
        "--tau",
        type=int,
        default=75,
        help="sync delay in inner steps of the overlapped streaming variant (default 75)",
    )
    parser.add_argument(
        "--merge-alpha", type=float, default=0.5, help="alpha of the overlapped variants (default 0.5)"
    )
    parser.add_argument(
        "--grace-s", type=float, default=1.0, help="the async variant's grace window (default 1 s)"
    )
    parser.add_argument("--dataset", default="shakespeare")
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "shakespeare"))
    parser.add_argument("--model", default="gpt", help="the model (default: the built-in GPT)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--sync-ratio",
        type=float,
        default=1.0,
        help="one full sync's time over one round of inner steps (default 1)",
    )
    parser.add_argument(
        "--scenarios",
        default="even,faults",
        help="comma-separated: even (equal speeds, no fault), faults (half-speed worker 3, worker 1 killed and "
        "restarted halfway; default both)",
    )
    parser.add_argument(
        "--link",
        choices=("relay", "lab"),
        default="relay",
        help="relay: every process on loopback, each region's link a fedgrid wan relay (default); lab: each "
        "process on a host of a network-namespace lab, each region's link shaped by the kernel (tbf) with "
        "fedgrid wan's delay (fedgrid.ops.lab; needs root)",
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories under this folder")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default benchmarks/results/goodput.json (--link lab: goodput-lab.json)",
    )
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = (
            ROOT / "benchmarks" / "results" / ("goodput-lab.json" if args.link == "lab" else "goodput.json")
        )
    cal = calibrate(args)
    if args.step_s:  # another run's calibration: runs of different code compared at one step time
        cal["step_s"] = args.step_s
    # A region's full sync moves its two workers' models up and down through one link.
    sync_bits = 2 * WORKERS_PER_REGION * cal["state_bytes"] * 8
    rate_mbit = sync_bits / (args.sync_ratio * args.inner_steps * cal["step_s"]) / 1e6
    link = WanLink(delay_ms=40.0, rate_mbit=rate_mbit)
    print(
        f"calibrated: step {cal['step_s'] * 1e3:.1f} ms, model {cal['state_bytes'] / 1e6:.2f} MB, "
        f"H={args.inner_steps}: a round of inner steps {args.inner_steps * cal['step_s']:.1f} s; link {rate_mbit:.2f} Mbit/s, 80 ms RTT",
        flush=True,
    )
    variants, modes, scenarios = args.variants.split(","), args.modes.split(","), args.scenarios.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedgrid-goodput-") as tmp:
        for repeat in range(args.repeats):
            order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
            for scenario in scenarios:
                for mode in modes:
                    for variant in order:
                        row = run(variant, mode, scenario, cal, link, args, args.keep or Path(tmp))
                        row.update(repeat=repeat, scenario=scenario)
                        rows.append(row)
                        print(
                            f"{scenario:>6} {mode:>4} {variant:>7}: utilization {row['utilization']:.3f}, "
                            f"{row['tokens_per_s']:.0f} tok/s, loss {row['held_out_loss']}, "
                            f"{row['bytes_per_worker_step'] / 1e6:.3f} MB/worker/step, {row['run_wall_s']:.0f}s",
                            flush=True,
                        )
    summary = []
    header = (
        f"{'scenario':>8} {'mode':>4} {'variant':>7} | {'utilization':>11} {'tok/s':>8} {'held-out loss':>13} "
        f"{'MB/worker/step':>14}"
    )
    print(header)
    print("-" * len(header))
    for scenario in scenarios:
        for mode in modes:
            for variant in variants:
                mine = [
                    r for r in rows if (r["scenario"], r["mode"], r["variant"]) == (scenario, mode, variant)
                ]
                losses = [r["held_out_loss"] for r in mine if r["held_out_loss"] is not None]
                entry = {
                    "scenario": scenario,
                    "mode": mode,
                    "variant": variant,
                    "utilization": statistics.median(r["utilization"] for r in mine),
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                    "held_out_loss": statistics.median(losses) if losses else None,
                    "bytes_per_worker_step": statistics.median(r["bytes_per_worker_step"] for r in mine),
                }
                summary.append(entry)
                loss = f"{entry['held_out_loss']:.4f}" if entry["held_out_loss"] is not None else "-"
                print(
                    f"{scenario:>8} {mode:>4} {variant:>7} | {entry['utilization']:>11.3f} {entry['tokens_per_s']:>8.0f} "
                    f"{loss:>13} {entry['bytes_per_worker_step'] / 1e6:>14.3f}"
                )
    report = {
        "benchmark": "goodput",
        "regions": REGIONS,
        "workers_per_region": WORKERS_PER_REGION,
        "slow_worker": SLOW_WORKER,
        "killed_worker": KILLED_WORKER,
        "calibration": cal,
        "link": {
            "kind": args.link,
            "delay_ms": link.delay_ms,
            "rtt_ms": 2 * link.delay_ms,
            "rate_mbit": link.rate_mbit,
        },
        "args": {k: str(v) for k, v in vars(args).items()},
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average": os.getloadavg(),
        },
        "rows": rows,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
