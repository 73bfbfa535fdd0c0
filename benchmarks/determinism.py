"""How far apart the engines and thread counts end, on the digits MLP (the numbers behind
``fedgrid.determinism.BATCHED_ATOL``).

For each round count, four runs of ``run_simulation`` (sequential and batched engine, 1
and 2 intra-op threads, seed 0, the defaults otherwise) and the largest absolute
difference between their final models: batched against sequential at each thread count,
and 1 against 2 threads on each engine. Prints a table and writes JSON.

    python benchmarks/determinism.py                   # about 20 s on 2 cores
    python benchmarks/determinism.py --rounds 3,10,30
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from fedgrid.config import load_config
from fedgrid.determinism import BATCHED_ATOL, environment
from fedgrid.simulation.run import run_simulation


def _gap(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", default="3,10", help="round counts, comma-separated")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "determinism.json"
    )
    args = parser.parse_args(argv)
    rows = []
    print(
        f"{'rounds':>6} | {'batched-seq 1t':>14} {'batched-seq 2t':>14} | {'seq 1t-2t':>10} {'batched 1t-2t':>13} | atol {BATCHED_ATOL:g}"
    )
    for rounds in (int(r) for r in args.rounds.split(",") if r):
        runs = {
            (engine, threads): run_simulation(
                load_config(
                    overrides={"rounds": rounds, "engine": engine, "threads": threads, "progress": False}
                )
            )[0]
            for engine in ("sequential", "batched")
            for threads in (1, 2)
        }
        row = {
            "rounds": rounds,
            "batched_vs_sequential_1_thread": _gap(runs["batched", 1], runs["sequential", 1]),
            "batched_vs_sequential_2_threads": _gap(runs["batched", 2], runs["sequential", 2]),
            "sequential_1_vs_2_threads": _gap(runs["sequential", 1], runs["sequential", 2]),
            "batched_1_vs_2_threads": _gap(runs["batched", 1], runs["batched", 2]),
        }
        rows.append(row)
        print(
            f"{rounds:>6} | {row['batched_vs_sequential_1_thread']:>14.2e} {row['batched_vs_sequential_2_threads']:>14.2e} | "
            f"{row['sequential_1_vs_2_threads']:>10.2e} {row['batched_1_vs_2_threads']:>13.2e} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "determinism",
                "environment": environment(),
                "machine": platform.machine(),
                "torch": torch.__version__,
                "batched_atol": BATCHED_ATOL,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
