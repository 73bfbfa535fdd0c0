"""The accuracy cost of differential privacy (DP-FedAvg, central noise) on Fashion-MNIST.

Issue 28's "Measure": ``--clients`` (100) clients of Fashion-MNIST (IID split of the 60k training
images), the same run without DP and with client-level DP at ``--epsilon`` (8) and delta 1e-5:

- ``no-dp``: FedAvg, example-weighted, no clipping, no noise;
- ``dp-fixed``: every update clipped to ``--clip`` (L2), Gaussian noise of std ``sigma * clip`` on
  the sum, uniform weights;
- ``dp-adaptive``: the same with the clip following the median update norm (Andrew et al. 2021,
  from 0.1).

``sigma`` is calibrated (``fedgrid.aggregation.accounting.calibrate_noise_multiplier``, the RDP
accountant) so that ``--rounds`` rounds at the sampling rate ``--fraction-fit`` spend at most
``--epsilon``; each DP run also has ``dp_epsilon`` set, so the run itself enforces the budget, and
its last round's recorded ``epsilon`` is reported. Everything else is the project's defaults
(client SGD lr 0.1, momentum 0.9, batch 32, one local epoch, seed 0) with ``--model`` (logistic).

Run: ``python benchmarks/dp_accuracy.py`` (about 5 minutes on 2 cores). Prints a table and writes
``benchmarks/results/dp_accuracy.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from fedgrid.aggregation.accounting import calibrate_noise_multiplier
from fedgrid.config import load_config
from fedgrid.simulation.run import run_simulation

DELTA = 1e-5


def _run(args: argparse.Namespace, dp: dict[str, Any]) -> dict[str, Any]:
    config = load_config(
        overrides={
            "dataset": "fashion-mnist",
            "data_dir": args.data,
            "model": args.model,
            "clients": args.clients,
            "rounds": args.rounds,
            "fraction_fit": args.fraction_fit,
            "partition": "iid",
            "local_epochs": 1,
            "seed": args.seed,
            "progress": False,
            **dp,
        }
    )
    start = time.monotonic()
    _, history = run_simulation(config)
    last = history[-1]
    return {
        "accuracy": last.accuracy,
        "rounds_run": len(history),
        "epsilon": last.extra.get("epsilon"),
        "final_clip": last.extra.get("dp_clip"),
        "accuracy_by_round": [m.accuracy for m in history],
        "wall_s": round(time.monotonic() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--fraction-fit", type=float, default=1.0)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--model", default="logistic")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "fashion-mnist")
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "dp_accuracy.json"))
    args = parser.parse_args()
    sigma = calibrate_noise_multiplier(
        epsilon=args.epsilon, delta=DELTA, q=args.fraction_fit, rounds=args.rounds, kind="rdp"
    )
    dp = {"dp_noise_multiplier": sigma, "dp_epsilon": args.epsilon, "dp_delta": DELTA, "dp_accountant": "rdp"}
    variants = {
        "no-dp": {},
        "dp-fixed": {**dp, "dp_clip": str(args.clip)},
        "dp-adaptive": {**dp, "dp_clip": "adaptive"},
    }
    rows = {name: _run(args, options) for name, options in variants.items()}
    print(
        f"Fashion-MNIST, {args.clients} clients (IID), {args.model}, {args.rounds} rounds, q = {args.fraction_fit}"
    )
    print(f"DP: epsilon {args.epsilon} at delta {DELTA}, noise multiplier {sigma:.4f} (RDP)\n")
    print("| variant | test accuracy | accuracy cost | epsilon spent | rounds | final clip |")
    print("|---|---|---|---|---|---|")
    base = rows["no-dp"]["accuracy"]
    for name, row in rows.items():
        eps = "-" if row["epsilon"] is None else f"{row['epsilon']:.3f}"
        clip = "-" if row["final_clip"] is None else f"{row['final_clip']:.3g}"
        print(
            f"| {name} | {row['accuracy']:.4f} | {base - row['accuracy']:+.4f} | {eps} | {row['rounds_run']} | {clip} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "args": vars(args),
        "noise_multiplier": sigma,
        "delta": DELTA,
        "variants": rows,
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
