"""A seeded chaos run: a two-region federation through emulated WAN links, faulted on a schedule,
must end on exactly the model of the same run without faults, every round exactly once.

Topology: a global coordinator (with a state directory), two regions (``fedgrid region``, each
with its state directory, H regional rounds a global round, two clients each on scikit-learn's
digits) reaching it through their own ``fedgrid.ops.wan.WanRelay`` (10 ms each way). Faults,
drawn from ``--seed`` (one a round from round 2, a kind and a target each):

- ``coordinator_kill``: SIGKILL of the global coordinator inside a round (at its
  ``aggregating`` event); restarted on its port from its state directory;
- ``full_disk``: the state directory's disk fills inside a round (at ``update_accepted``:
  every later write fails with ENOSPC, ``tests/support/full_disk.py``): the coordinator stops
  with one line; after ``--hold-s`` (space freed) it is restarted;
- ``region_kill``: SIGKILL of a region during its regional rounds; restarted on its port after
  ``--hold-s``: it rejoins its open global round and runs its regional rounds again;
- ``client_kill``: SIGKILL of a client during a round; restarted: it rejoins its region's round;
- ``partition``: a region's WAN link blackholes for ``--hold-s``, then heals.

Heartbeats are 10 s, so a process down for a few seconds is still in its round (a tier only
drops a silent member after three heartbeats); a round that loses every result anyway is run
again under its number (``round_failed``). The reference run is the same topology, the same
flags and seed, without faults.

Reported: the faults injected and survived, rounds retried (``round_failed`` events) and redone
after a restart (a round opened by more than one start), tasks handed over to a restarted
member, and whether the final models are equal bit for bit and every round (global and each
region's) ran exactly once.

Run: ``python benchmarks/chaos.py [--rounds 8] [--seed 7]``; writes
``benchmarks/results/chaos.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from fedgrid.events import read_events  # noqa: E402
from fedgrid.ops.wan import WanLink, WanRelay  # noqa: E402
from fedgrid.runlog import load_model, read_metrics  # noqa: E402

from harness import FEDGRID, THREADS, CoordinatorRun, child_env, wait_until  # noqa: E402

KINDS = ("coordinator_kill", "full_disk", "region_kill", "client_kill", "partition")
REGIONS, CLIENTS_PER_REGION = ("region-a", "region-b"), 2
#: Where a coordinator fault lands: the event it fires on.
COORDINATOR_EVENTS: dict[str, tuple[str, int | str]] = {
    "coordinator_kill": ("aggregating", signal.SIGKILL),
    "full_disk": ("update_accepted", "ENOSPC"),
}


@dataclass(frozen=True)
class Fault:
    round: int
    kind: str
    target: str  # a region's name, a client's index, or "coordinator"


def schedule(seed: int, rounds: int, kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """One fault a round from round 2 to the one before the last, each kind at least once
    (while rounds last), seeded. (Not in the last round: a member restarted once the run is
    over would wait for a coordinator that is gone.)"""
    rng = random.Random(seed)
    count = max(0, rounds - 2)
    chosen = list(kinds)[:count] + [rng.choice(kinds) for _ in range(count - len(kinds))]
    rng.shuffle(chosen)
    faults = []
    for r, kind in zip(range(2, rounds), chosen):
        if kind in ("region_kill", "partition"):
            target = rng.choice(REGIONS)
        elif kind == "client_kill":
            target = str(rng.randrange(len(REGIONS) * CLIENTS_PER_REGION))
        else:
            target = "coordinator"
        faults.append(Fault(r, kind, target))
    return faults


@dataclass
class Report:
    faults: list[dict[str, Any]] = field(default_factory=list)
    survived: int = 0
    rounds_retried: int = 0
    rounds_redone: int = 0
    tasks_handed_over: int = 0
    coordinator_starts: int = 0


class Federation:
    """The topology of the module docstring, in ``work``; ``faults`` applied while it runs."""

    def __init__(
        self, work: Path, *, rounds: int, seed: int, h: int, hold_s: float, faults: list[Fault]
    ) -> None:
        self.work, self.rounds, self.seed, self.h, self.hold_s = work, rounds, seed, h, hold_s
        self.faults = faults
        self.env = {**child_env(), "FEDGRID_RETRY_MAX_WAIT_S": "1"}
        self.top = work / "global"
        self.coordinator_faults = [f for f in faults if f.kind in COORDINATOR_EVENTS]
        self.runs: list[CoordinatorRun] = []
        self.relays: dict[str, WanRelay] = {}
        self.regions: dict[str, subprocess.Popen] = {}
        self.region_addresses: dict[str, str] = {}
        self.clients: dict[int, subprocess.Popen] = {}
        self.report = Report()

    # -- processes --------------------------------------------------------------------------
    def _coordinator(self, listen: str) -> CoordinatorRun:
        fault = self.coordinator_faults.pop(0) if self.coordinator_faults else None
        trigger: tuple[int, str] | None = None
        sig: int | str = signal.SIGKILL
        if fault is not None:
            event, sig = COORDINATOR_EVENTS[fault.kind]
            trigger = (fault.round, event)
        args = ["--listen", listen, "--rounds", str(self.rounds), "--min-clients", str(len(REGIONS))]
        args += ["--seed", str(self.seed), "--heartbeat-interval-s", "10", "--round-timeout-s", "300"]
        args += ["--state-dir", str(self.work / "global-state")]
        self.report.coordinator_starts += 1
        return CoordinatorRun(self.top, args, self.work / "global.log", trigger=trigger, sig=sig)

    def _popen(self, command: list[str], log: Path) -> subprocess.Popen:
        return subprocess.Popen(command, stdout=open(log, "a"), stderr=subprocess.STDOUT, env=self.env)

    def _region(self, name: str, listen: str) -> subprocess.Popen:
        command = [*FEDGRID, "region", "--upstream", self.relays[name].address, "--name", name]
        command += ["--listen", listen, "--out", str(self.work / name), "--threads", str(THREADS)]
        command += ["--state-dir", str(self.work / f"{name}-state"), "--seed", str(self.seed)]
        members = sum(1 for region in deal(self.seed).values() if region == name)
        command += ["--min-clients", str(members), "--regional-rounds", str(self.h)]
        command += ["--heartbeat-interval-s", "10", "--round-timeout-s", "300"]
        return self._popen(command, self.work / f"{name}.log")

    def _client(self, i: int) -> subprocess.Popen:
        region = deal(self.seed)[i]
        total = len(REGIONS) * CLIENTS_PER_REGION
        command = [
            *FEDGRID,
            "client",
            "--coordinator",
            self.region_addresses[region],
            "--threads",
            str(THREADS),
        ]
        command += ["--partition", f"{i}/{total}", "--seed", str(self.seed)]
        return self._popen(command, self.work / f"client{i}.log")

    def start(self) -> None:
        self.runs.append(self._coordinator("127.0.0.1:0"))
        self.address = self.runs[0].address()
        for name in REGIONS:
            self.relays[name] = WanRelay(self.address, link=WanLink(delay_ms=10)).start()
            self.regions[name] = self._region(name, "127.0.0.1:0")
            path = self.work / name / "address"
            wait_until(
                lambda: path.exists() and path.read_text().strip() != "",
                timeout=120,
                what=f"{name}'s address",
            )
            self.region_addresses[name] = path.read_text().strip()
        for i in range(len(REGIONS) * CLIENTS_PER_REGION):
            self.clients[i] = self._client(i)

    def stop(self) -> None:
        for proc in [*(r.proc for r in self.runs), *self.regions.values(), *self.clients.values()]:
            if proc.poll() is None:
                proc.kill()
        for relay in self.relays.values():
            relay.stop()

    # -- faults -----------------------------------------------------------------------------
    def _open_round(self) -> int:
        opened = [e["round"] for run in self.runs for e in run.seen("round_opened", phase="fit")]
        return max(opened, default=0)

    def _apply(self, fault: Fault, rng: random.Random) -> None:
        time.sleep(rng.uniform(0.05, 0.3))  # somewhere inside the round (a round takes about 0.4 s)
        if fault.kind == "partition":
            self.relays[fault.target].partition("blackhole")
            time.sleep(self.hold_s)
            self.relays[fault.target].heal()
        elif fault.kind == "region_kill":
            self.regions[fault.target].kill()
            self.regions[fault.target].wait(timeout=30)
            time.sleep(self.hold_s)
            self.regions[fault.target] = self._region(fault.target, self.region_addresses[fault.target])
        else:  # client_kill
            i = int(fault.target)
            self.clients[i].kill()
            self.clients[i].wait(timeout=30)
            self.clients[i] = self._client(i)
        self.report.survived += 1

    def drive(self, timeout_s: float) -> None:
        """Applies the faults as their rounds open, restarts the coordinator after its own, until
        the run finishes (or ``timeout_s`` passes)."""
        rng = random.Random(self.seed)
        pending = [f for f in self.faults if f.kind not in COORDINATOR_EVENTS]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            run = self.runs[-1]
            code = run.proc.poll()
            if code == 0:
                break
            if code is not None:  # killed, or stopped by its full disk: restarted on its port
                if code == 1:
                    time.sleep(self.hold_s)  # the disk stays full a while, then space is freed
                self.report.survived += 1
                self.runs.append(self._coordinator(self.address))
                continue
            for fault in [f for f in pending if self._open_round() >= f.round]:
                pending.remove(fault)
                self._apply(fault, rng)
            time.sleep(0.1)
        else:
            raise TimeoutError(f"the run did not finish within {timeout_s:.0f}s (logs in {self.work})")
        for proc in [*self.regions.values(), *self.clients.values()]:
            assert proc.wait(timeout=120) == 0, f"a process failed (logs in {self.work})"

    def tally(self) -> Report:
        self.report.faults = [asdict(f) for f in self.faults]
        events = read_events(self.top / "events.jsonl")
        self.report.rounds_retried = sum(1 for e in events if e.event == "round_failed")
        opened: dict[int, int] = {}
        for run in self.runs:
            for r in {e["round"] for e in run.seen("round_opened", phase="fit")}:
                opened[r] = opened.get(r, 0) + 1
        self.report.rounds_redone = sum(n - 1 for n in opened.values())
        self.report.tasks_handed_over = sum(
            1
            for path in [self.top, *(self.work / name for name in REGIONS)]
            for e in read_events(path / "events.jsonl")
            if e.event == "task_handed_over"
        )
        return self.report


def deal(seed: int) -> dict[int, str]:
    """Client index -> region, as ``fedgrid simulate --hierarchy`` deals them (so the simulation
    is a reference too)."""
    from fedgrid.simulation.heterogeneity import ClientProfiles

    total = len(REGIONS) * CLIENTS_PER_REGION
    profiles = ClientProfiles(total, seed=seed, regions=",".join(f"{name}:0.5" for name in REGIONS))
    return {i: profiles.region(i) for i in range(total)}


def simulated_model(work: Path, *, rounds: int, seed: int, h: int) -> dict[str, Any]:
    """The same hierarchy simulated in this process (one thread, sequential): bit for bit the
    deployment's model (docs/regions.rst)."""
    from fedgrid.config import load_config
    from fedgrid.simulation.run import run_simulation

    overrides: dict[str, Any] = {"rounds": rounds, "clients": len(REGIONS) * CLIENTS_PER_REGION, "seed": seed}
    overrides |= {"regions": ",".join(f"{name}:0.5" for name in REGIONS), "hierarchy": True}
    overrides |= {
        "regional_rounds": h,
        "out": str(work / "simulated"),
        "threads": THREADS,
        "engine": "sequential",
    }
    model, _ = run_simulation(load_config(overrides=overrides))
    return dict(model)


def run_federation(
    work: Path, *, rounds: int, seed: int, h: int, hold_s: float, faults: list[Fault]
) -> Federation:
    """Runs the federation to its end with ``faults``; returns it (its run directories in ``work``)."""
    work.mkdir(parents=True, exist_ok=True)
    federation = Federation(work, rounds=rounds, seed=seed, h=h, hold_s=hold_s, faults=faults)
    try:
        federation.start()
        federation.drive(timeout_s=120 + 60 * rounds)
    finally:
        federation.stop()
    return federation


def compare(faulted: Path, clean: Path, *, rounds: int, h: int) -> dict[str, Any]:
    """Whether the two runs ended on the same model bit for bit, and ran every round once."""
    left, right = (
        load_model(faulted / "global" / "model.safetensors"),
        load_model(clean / "global" / "model.safetensors"),
    )
    identical = set(left) == set(right) and all(bool((left[k] == right[k]).all()) for k in left)
    once = [m["round"] for m in read_metrics(faulted / "global")] == list(range(1, rounds + 1))
    regions_once = all(
        [m["round"] for m in read_metrics(faulted / name)] == list(range(1, rounds * h + 1))
        for name in REGIONS
    )
    return {"identical": identical, "every_round_once": once, "every_regional_round_once": regions_once}


def _print(result: dict[str, Any], faults: list[Fault]) -> None:
    print(
        f"chaos: {len(faults)} faults ({', '.join(f'{f.kind}@{f.round}' for f in faults)}), {result['survived']} survived"
    )
    print(
        f"  rounds retried {result['rounds_retried']}, redone after a restart {result['rounds_redone']}, "
        f"tasks handed over {result['tasks_handed_over']}, coordinator starts {result['coordinator_starts']}"
    )
    print(
        f"  final model identical to the run without faults: {result['identical']}; every round once: "
        f"{result['every_round_once']} (regions: {result['every_regional_round_once']}); "
        f"wall {result['wall_s']['clean']} s clean, {result['wall_s']['chaos']} s with faults"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="at least 7: faults hit rounds 2 to N-1")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--regional-rounds", type=int, default=2)
    parser.add_argument(
        "--hold-s", type=float, default=3.0, help="how long a fault holds (down, partitioned, full)"
    )
    parser.add_argument("--out", default=str(HERE_RESULTS / "chaos.json"))
    parser.add_argument(
        "--work", default="", help="keep the run directories and logs here (default: a temporary one)"
    )
    args = parser.parse_args()
    faults = schedule(args.seed, args.rounds)
    with (
        contextlib.nullcontext(args.work)
        if args.work
        else tempfile.TemporaryDirectory(prefix="fedgrid-chaos-") as tmp
    ):
        common: dict[str, Any] = {
            "rounds": args.rounds,
            "seed": args.seed,
            "h": args.regional_rounds,
            "hold_s": args.hold_s,
        }
        started = time.monotonic()
        clean = run_federation(Path(tmp, "clean"), faults=[], **common)
        clean_s = time.monotonic() - started
        started = time.monotonic()
        faulted = run_federation(Path(tmp, "chaos"), faults=faults, **common)
        chaos_s = time.monotonic() - started
        result = {
            "rounds": args.rounds,
            "seed": args.seed,
            "regional_rounds": args.regional_rounds,
            **asdict(faulted.tally()),
            **compare(faulted.work, clean.work, rounds=args.rounds, h=args.regional_rounds),
            "wall_s": {"clean": round(clean_s, 1), "chaos": round(chaos_s, 1)},
        }
    _print(result, faults)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return (
        0 if result["identical"] and result["every_round_once"] and result["every_regional_round_once"] else 1
    )


HERE_RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    sys.exit(main())
