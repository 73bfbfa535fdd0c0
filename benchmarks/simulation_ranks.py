"""A simulation on 1 process against the same simulation sharded over 2 (torchrun, gloo), each on one thread.

The run: Fashion-MNIST (``--data-dir``, default ``../shared/data/fashion-mnist`` beside the
checkout; digits when it is missing), 100 clients, Dirichlet 0.5, the 784-200-200-10 MLP,
one local epoch, the batched engine (``--engine``), every client every round. Each
configuration runs ``--repeats`` times, interleaved; a run's figure is the median wall time
of its rounds after the first (the first compiles and warms up); the table shows the
median over repetitions and the speed-up (1 process / 2 processes).

Run: ``python benchmarks/simulation_ranks.py [--repeats 3] [--rounds 4]``; writes
``benchmarks/results/simulation_ranks.json``.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "fashion-mnist"


def _once(ranks: int, out: Path, flags: list[str]) -> float:
    launcher = (
        [sys.executable, "-m", "fedgrid.cli"]
        if ranks == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
            "-m",
            "fedgrid.cli",
        ]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [*launcher, "simulate", "--out", str(out), "--threads", "1", "--progress", "false", *flags],
        check=True,
        stdout=subprocess.DEVNULL,
        env=env,
    )
    walls = [
        json.loads(line)["wall_s"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return statistics.median(walls[1:] if len(walls) > 1 else walls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--engine", default="batched")
    parser.add_argument("--data-dir", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "simulation_ranks.json")
    args = parser.parse_args(argv)
    dataset = (
        ["--dataset", "fashion-mnist", "--data-dir", str(args.data_dir), "--model", "mlp"]
        if args.data_dir.exists()
        else ["--dataset", "digits"]
    )
    flags = [
        *dataset,
        "--clients",
        str(args.clients),
        "--rounds",
        str(args.rounds),
        "--local-epochs",
        "1",
        "--lr",
        "0.05",
        "--momentum",
        "0",
        "--engine",
        args.engine,
        "--seed",
        "0",
    ]
    times: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="fedgrid-ranks-") as tmp:
        for r in range(args.repeats):
            for ranks in (1, 2):
                times[ranks].append(_once(ranks, Path(tmp) / f"r{r}-{ranks}", flags))
                print(f"repeat {r + 1}: {ranks} process(es): {times[ranks][-1]:.3f} s/round", flush=True)
    one, two = statistics.median(times[1]), statistics.median(times[2])
    print(f"{'processes':>9} | {'s/round (median)':>16} | {'speed-up':>8}")
    print(f"{1:>9} | {one:>16.3f} | {1.0:>8.2f}")
    print(f"{2:>9} | {two:>16.3f} | {one / two:>8.2f}")
    report: dict[str, Any] = {
        "benchmark": "simulation_ranks",
        "flags": flags,
        "repeats": args.repeats,
        "s_per_round": times,
        "median_s_per_round": {"1": one, "2": two},
        "speedup": one / two,
        "environment": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
