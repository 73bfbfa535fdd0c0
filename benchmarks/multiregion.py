"""Flat against regional aggregation over the same emulated WAN: round time, WAN bytes, accuracy.

Topology: 3 regions x 4 clients and a global coordinator. Each region reaches the global
coordinator through its own emulated WAN link (``fedgrid.ops.wan.WanRelay``: 50 ms each way,
so 100 ms RTT, 20 Mbit/s each way shared by the region's connections, 0.1% segment loss),
as a site's uplink would be shared.

- **flat**: the 12 clients are clients of the global coordinator, each through its
  region's link; updates are uncompressed (``codec none``).
- **regional**: each region runs ``fedgrid region`` beside its clients (no WAN between
  them), ``--regional-rounds`` H per global round, and only the aggregator crosses the
  WAN, with the global coordinator's WAN uplink codec (``--wan-codec``, int8 by default,
  with error feedback).

Both run the same number of global rounds on the same data (scikit-learn's digits, which
ship with the package, 12 partitions; the MLPs below), one local epoch, and the same seed.
Reported per model: the median global round wall time after the first (the global
coordinator's ``metrics.jsonl``; the first includes every process starting and joining), the WAN bytes (counted at the relays, both directions, all rounds), and
the final accuracy of the global model on the digits test split.

Run: ``python benchmarks/multiregion.py [--rounds 4] [--models 1M,25M]``; writes
``benchmarks/results/multiregion.json``. Every process runs one torch thread; the machine's
cores are shared by the 16 processes, so training time is part of both topologies' rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fedgrid.ops.wan import WanLink, WanRelay  # noqa: E402
from fedgrid.runlog import load_model, read_metrics  # noqa: E402

REGIONS, CLIENTS_PER_REGION = 3, 4
SEED = 5
FEDGRID = [sys.executable, "-m", "fedgrid.cli"]


def mlp_1m() -> nn.Module:
    """64-1024-1024-10: about 1.1M parameters."""
    return nn.Sequential(
        nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def mlp_25m() -> nn.Module:
    """64-4096-4096-2048-10: about 25.4M parameters."""
    return nn.Sequential(
        nn.Linear(64, 4096),
        nn.ReLU(),
        nn.Linear(4096, 4096),
        nn.ReLU(),
        nn.Linear(4096, 2048),
        nn.ReLU(),
        nn.Linear(2048, 10),
    )


MODELS = {"1M": "multiregion:mlp_1m", "25M": "multiregion:mlp_25m"}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    return env


def _start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [*FEDGRID, *args, "--threads", "1"], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=_env()
    )


def _address(out: Path, proc: subprocess.Popen, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    path = out / "address"
    while not (path.exists() and path.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no address in {path}: {proc.args}")
        time.sleep(0.05)
    return path.read_text().strip()


def _accuracy(model_path: Path, factory: str) -> float:
    from fedgrid.plugins import load_object
    from fedgrid.simulation.datasets import load_digits

    model = load_object(factory, key="model")()
    model.load_state_dict(load_model(model_path))
    data = load_digits()
    with torch.no_grad():
        return float((model(data.x_test).argmax(1) == data.y_test).float().mean())


def run(
    topology: str, model: str, rounds: int, regional_rounds: int, wan_codec: str, link: WanLink, work: Path
) -> dict[str, Any]:
    """One run of ``topology`` (flat or regional); returns its figures."""
    out = work / f"{topology}-{model}"
    total = REGIONS * CLIENTS_PER_REGION
    # A 60 s heartbeat: over a saturated link a client's heartbeats wait behind its own transfer on the one
    # connection, and an upload's first 1 MiB chunk takes seconds to arrive (see the closing note of issue 13).
    common = [
        "--seed",
        str(SEED),
        "--local-epochs",
        "1",
        "--lr",
        "0.05",
        "--round-timeout-s",
        "3600",
        "--heartbeat-interval-s",
        "60",
    ]
    coordinator_args = [
        "coordinator",
        "--listen",
        "127.0.0.1:0",
        "--out",
        str(out / "global"),
        "--rounds",
        str(rounds),
        "--model",
        MODELS[model],
        *common,
    ]
    if topology == "flat":
        coordinator_args += ["--min-clients", str(total)]
    else:
        coordinator_args += ["--min-clients", str(REGIONS), "--codec", wan_codec]
    out.mkdir(parents=True)
    procs = [_start(coordinator_args, out / "global.log")]
    relays: list[WanRelay] = []
    started = time.monotonic()
    try:
        address = _address(out / "global", procs[0])
        for r in range(REGIONS):
            relay = WanRelay(
                address,
                link=WanLink(delay_ms=link.delay_ms, rate_mbit=link.rate_mbit, loss=link.loss, seed=r),
            ).start()
            relays.append(relay)
            clients_target = relay.address
            if topology == "regional":
                name = f"region-{r}"
                region = _start(
                    [
                        "region",
                        "--upstream",
                        relay.address,
                        "--name",
                        name,
                        "--listen",
                        "127.0.0.1:0",
                        "--out",
                        str(out / name),
                        "--min-clients",
                        str(CLIENTS_PER_REGION),
                        "--regional-rounds",
                        str(regional_rounds),
                        *common,
                    ],
                    out / f"{name}.log",
                )
                procs.append(region)
                clients_target = _address(out / name, region)
            for c in range(CLIENTS_PER_REGION):
                i = r * CLIENTS_PER_REGION + c
                procs.append(
                    _start(
                        [
                            "client",
                            "--coordinator",
                            clients_target,
                            "--partition",
                            f"{i}/{total}",
                            "--seed",
                            str(SEED),
                            "--model",
                            MODELS[model],
                            "--lr",
                            "0.05",
                        ],
                        out / f"client-{i}.log",
                    )
                )
        for proc in procs:
            if proc.wait(timeout=7200) != 0:
                raise RuntimeError(f"{proc.args} exited {proc.returncode}; see {out}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for relay in relays:
            relay.stop()
    metrics = read_metrics(out / "global")
    walls = [m["wall_s"] for m in metrics]
    return {
        "topology": topology,
        "model": model,
        "rounds": rounds,
        "regional_rounds": regional_rounds if topology == "regional" else None,
        "wan_codec": wan_codec if topology == "regional" else "none",
        "round_wall_s": walls,
        "median_round_s": statistics.median(walls[1:] if len(walls) > 1 else walls),
        "wan_bytes": sum(r.bytes_up + r.bytes_down for r in relays),
        "wan_bytes_up": sum(r.bytes_up for r in relays),
        "wan_bytes_down": sum(r.bytes_down for r in relays),
        "accuracy": _accuracy(out / "global" / "model.safetensors", MODELS[model]),
        "total_s": time.monotonic() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="global rounds of each run (default 4)")
    parser.add_argument(
        "--regional-rounds", type=int, default=2, help="H of the regional topology (default 2)"
    )
    parser.add_argument("--models", default="1M,25M", help="comma-separated: 1M, 25M (default both)")
    parser.add_argument("--wan-codec", default="int8", help="the regions' WAN uplink codec (default int8)")
    parser.add_argument(
        "--delay-ms", type=float, default=50.0, help="one-way delay of each WAN link (default 50: 100 ms RTT)"
    )
    parser.add_argument(
        "--rate-mbit", type=float, default=20.0, help="bandwidth of each WAN link each way (default 20)"
    )
    parser.add_argument(
        "--loss", type=float, default=0.001, help="segment loss of each WAN link (default 0.001)"
    )
    parser.add_argument(
        "--topologies", default="flat,regional", help="comma-separated: flat, regional (default both)"
    )
    parser.add_argument(
        "--keep", type=Path, default=None, help="keep every run directory and log under this folder"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "multiregion.json")
    args = parser.parse_args(argv)
    link = WanLink(delay_ms=args.delay_ms, rate_mbit=args.rate_mbit, loss=args.loss)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedgrid-multiregion-") as tmp:
        for model in args.models.split(","):
            for topology in args.topologies.split(","):
                row = run(
                    topology,
                    model,
                    args.rounds,
                    args.regional_rounds,
                    args.wan_codec,
                    link,
                    args.keep or Path(tmp),
                )
                rows.append(row)
                print(
                    f"{model:>4} {topology:>8}: median round {row['median_round_s']:.1f}s, WAN {row['wan_bytes'] / 1e6:.1f} MB, "
                    f"accuracy {row['accuracy']:.4f} ({row['total_s']:.0f}s)",
                    flush=True,
                )
    header = (
        f"{'model':>5} | {'flat s/round':>12} {'regional s/round':>16} {'speed-up':>8} | {'flat WAN MB':>11} {'regional WAN MB':>15} | "
        f"{'flat acc':>8} {'regional acc':>12}"
    )
    print(header)
    print("-" * len(header))
    summary = []
    for model in args.models.split(",") if args.topologies == "flat,regional" else []:
        flat, regional = (
            next(r for r in rows if r["model"] == model and r["topology"] == t) for t in ("flat", "regional")
        )
        speedup = flat["median_round_s"] / regional["median_round_s"]
        summary.append(
            {
                "model": model,
                "speedup": speedup,
                "wan_bytes_ratio": flat["wan_bytes"] / regional["wan_bytes"],
                "accuracy_delta_points": 100 * (regional["accuracy"] - flat["accuracy"]),
            }
        )
        print(
            f"{model:>5} | {flat['median_round_s']:>12.1f} {regional['median_round_s']:>16.1f} {speedup:>7.1f}x | "
            f"{flat['wan_bytes'] / 1e6:>11.1f} {regional['wan_bytes'] / 1e6:>15.1f} | {flat['accuracy']:>8.4f} {regional['accuracy']:>12.4f}"
        )
    report = {
        "benchmark": "multiregion",
        "regions": REGIONS,
        "clients_per_region": CLIENTS_PER_REGION,
        "link": {
            "delay_ms": link.delay_ms,
            "rtt_ms": 2 * link.delay_ms,
            "rate_mbit": link.rate_mbit,
            "loss": link.loss,
        },
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
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
