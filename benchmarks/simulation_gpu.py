"""Federated simulation on one GPU (issue 16, item 4): fedgrid's batched engine against the
plain PyTorch loop on the same device, 1,000 Fashion-MNIST clients, the MLP and the CNN.

The work is ``simulation.py``'s (Dirichlet(0.5) split, every client training every round,
1 local epoch, batch 32, SGD lr 0.05, FedAvg by examples, one shared initial model), and
so are the workers: each run is ``simulation.py --worker`` in a process of its own, so its
``torch.cuda.max_memory_allocated`` is its own and the engine sees the whole device's free
memory (this parent never creates a CUDA context). Per model it measures:

- client updates per second: clients / seconds per round (the median of the rounds after
  ``--warmup``), for ``engine="batched"`` (``run_simulation``, ``batch_clients`` 0) and for
  ``simulation.py``'s ``loop`` (whole client tensors on the GPU, randperm + index slicing,
  one model);
- peak GPU memory of each run (``torch.cuda.max_memory_allocated``);
- K, the clients the engine trains at once: the values ``BatchedTrainer.chunk_size()``
  returned, and the free and total CUDA memory ``memory_budget`` read when it was called
  (the first call comes before the clients' data is on the device);
- the ratio, the loop's seconds per round over the engine's. With ``--loop-clients N``
  the loop trains N evenly spaced clients of the same partition, and its round is scaled
  to all clients by examples (time per round is linear in steps); the output says so, and
  the loop's model is then not comparable, so no accuracy check.

Goals printed: at least 10x the loop, at least 2,000 client updates per second for the MLP.
Sized for 10 minutes of device time: ``--rounds`` 3 (1 warm-up), and ``--budget-s`` (480)
caps the whole run: each run gets the time left, less 45 s for each run after it; a run
that would start with under 30 s is skipped, and one that runs out of time keeps the rounds
it finished (without its final model and peak memory), each reported as such. The loop
issues no host synchronization inside a round (its permutations go over through pinned
memory), so both sides are timed with one ``torch.cuda.synchronize`` per round.

    python3 benchmarks/simulation_gpu.py                                   # on a CUDA machine
    python3 benchmarks/simulation_gpu.py --device cpu --clients 20 --rounds 2   # smoke test

fedgrid must be importable (``pip install --no-deps -e .`` plus its dependencies) and the
Fashion-MNIST files present: ``--data-dir``, by default ``shared/data/fashion-mnist`` in the
repository or beside it. Results go to ``benchmarks/results/simulation_gpu.json``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from simulation import (  # noqa: E402
    accuracy,
    add_work_arguments,
    check_work_arguments,
    combine,
    prepare,
    run_variant,
    summarize,
    train_flops_per_example,
    write_results,
)

__all__ = ["main"]

GOAL_RATIO = 10.0
GOAL_MLP_UPDATES_PER_S = 2000.0
RESERVE_S = 45.0  # kept back for each run still to come
MIN_RUN_S = 30.0


@dataclass
class Budget:
    """The seconds left until ``deadline``, shared among the runs still to come."""

    deadline: float
    runs_left: int

    def next_run_s(self) -> float:
        """Seconds the next run may take: the time left, less ``RESERVE_S`` for each run after it."""
        left = self.deadline - time.monotonic() - RESERVE_S * (self.runs_left - 1)
        self.runs_left -= 1
        return left


def default_data_dir() -> Path:
    """``shared/data/fashion-mnist`` inside the repository if there, else beside it."""
    inside = HERE.parent / "shared" / "data" / "fashion-mnist"
    return inside if inside.exists() else HERE.parents[1] / "shared" / "data" / "fashion-mnist"


def loop_subset(clients: int, wanted: int) -> list[int] | None:
    """``wanted`` evenly spaced client indices out of ``clients`` (``None``: all of them)."""
    if wanted <= 0 or wanted >= clients:
        return None
    return sorted({i * clients // wanted for i in range(wanted)})


def k_summary(run: dict[str, Any]) -> dict[str, Any]:
    """What the engine chose in one run: K and the memory it came from (``simulation.py``'s record)."""
    record = run.get("engine_k") or {}
    budgets = record.get("budgets") or []
    first = budgets[0] if budgets else {}
    out: dict[str, Any] = {
        "k_values": record.get("k_values", []),
        "budget_bytes": first.get("budget_bytes"),
        "free_bytes": first.get("free_bytes"),
        "total_bytes": first.get("total_bytes"),
    }
    last = record.get("last_budget") or {}
    if last and last != first:
        out["last_budget_bytes"], out["last_free_bytes"] = last.get("budget_bytes"), last.get("free_bytes")
    out["engine_log"] = [n for n in run.get("notes", []) if n.startswith("engine:")]
    return out


def measure_model(
    args: argparse.Namespace,
    work: Path,
    model: str,
    shared: dict[str, Any],
    budget: Budget,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The batched engine and the loop on ``model``, ``--repeats`` times interleaved."""
    per_example = train_flops_per_example(model, args.batch_size)
    flops_round = per_example * shared["examples"] * args.local_epochs
    subset = loop_subset(args.clients, args.loop_clients)
    subset_examples = sum(shared["sizes"][i] for i in subset) if subset else shared["examples"]
    scale = shared["examples"] / subset_examples  # the loop's round, scaled to every client by examples
    runs: dict[str, list[dict[str, Any]]] = {"batched": [], "loop": []}
    for repeat in range(args.repeats):
        for variant in runs:
            left = budget.next_run_s()
            if left < MIN_RUN_S:
                runs[variant].append(
                    {"error": f"skipped: the --budget-s {args.budget_s:.0f} s budget is spent"}
                )
                log(f"  {model} / {variant}: skipped (budget spent)")
                continue
            log(
                f"  running {model} / {variant} (repeat {repeat + 1}/{args.repeats}, at most {left:.0f} s) ..."
            )
            extra = {"loop_clients": subset} if variant == "loop" and subset else None
            row = run_variant(
                args, work, model, variant, None, repeat=repeat, extra=extra, timeout=min(args.timeout, left)
            )
            if (
                len(row.get("partial_round_s", [])) > args.warmup
            ):  # timed out after some timed rounds: keep them
                row = {
                    "round_s": row["partial_round_s"],
                    "timed_out": row.pop("error"),
                    "notes": [
                        f"timed out after {len(row['partial_round_s'])} round(s): no final model, no peak memory"
                    ],
                }
            summarize(row, args, flops_round, shared["examples"])
            if "error" not in row and variant == "loop" and subset:  # scaled to every client by examples
                row["measured_s_per_round"], row["measured_round_s"] = row["s_per_round"], row["round_s"]
                row["round_s"] = [t * scale for t in row["round_s"]]
                summarize(row, args, flops_round, shared["examples"])
            if row.get("final_path") and (variant != "loop" or not subset):
                row["accuracy"] = accuracy(model, row["final_path"], shared["x_test"], shared["y_test"])
            row.pop("final_path", None)
            row.pop("extra", None)
            runs[variant].append(row)
            if "error" in row:
                log(f"    FAILED: {row['error'][:400]}")
                continue
            gpu = f", peak GPU {row['peak_gpu_mib']:.0f} MiB" if row.get("peak_gpu_mib") is not None else ""
            log(f"    {row['s_per_round']:.3f} s/round, {row['clients_per_s']:.1f} client updates/s{gpu}")
            for note in row.get("notes", []) if repeat == 0 else []:
                log(f"      {note}")
    rows = {v: combine(r, args, flops_round) for v, r in runs.items()}
    b, lp = rows["batched"], rows["loop"]
    ratio = lp["s_per_round"] / b["s_per_round"] if "error" not in b and "error" not in lp else None
    good_batched = [r for r in runs["batched"] if "error" not in r]
    recorded = next((r for r in good_batched if r.get("engine_k")), None)
    per_repeat = [
        bl["s_per_round"] / bb["s_per_round"] if "s_per_round" in bl and "s_per_round" in bb else None
        for bb, bl in zip(runs["batched"], runs["loop"])
    ]
    accs = [a for r in rows.values() for a in r.get("accuracies", [])]
    return {
        "flops_per_example": per_example,
        "flops_per_round": flops_round,
        "variants": rows,
        "k": k_summary(recorded) if recorded else {},
        "gpu": next((r.get("gpu") for r in good_batched if r.get("gpu")), None),
        "loop_clients": len(subset) if subset else args.clients,
        "loop_examples": subset_examples,
        "loop_scale": scale,
        "ratio_batched_over_loop": ratio,
        "ratio_per_repeat": per_repeat,
        "goal_ratio": GOAL_RATIO,
        "ratio_met": None if ratio is None else ratio >= GOAL_RATIO,
        "goal_updates_per_s": GOAL_MLP_UPDATES_PER_S if model == "mlp" else None,
        "updates_per_s_met": (b["clients_per_s"] >= GOAL_MLP_UPDATES_PER_S if "error" not in b else None)
        if model == "mlp"
        else None,
        "accuracy_spread_points": 100 * (max(accs) - min(accs)) if len(accs) > 1 else None,
    }


def log_results(args: argparse.Namespace, results: dict[str, Any], log: Callable[[str], None]) -> None:
    gib = 2**30
    log(
        f"\n=== {args.clients} clients on {args.device}; per run the median of {args.rounds - args.warmup} round(s) after "
        f"{args.warmup} warm-up, per engine the median of {args.repeats} run(s) ==="
    )
    log(
        f"{'model':<6}{'engine':<9}{'s/round':>9}{'updates/s':>11}{'peak GPU MiB':>14}{'peak RSS MiB':>14}{'accuracy':>10}  notes"
    )
    for model, res in results.items():
        for variant, row in res["variants"].items():
            if "error" in row:
                log(f"{model:<6}{variant:<9} FAILED: {row['error'][:300]}")
                continue
            gpu = f"{row['peak_gpu_mib']:.0f}" if row.get("peak_gpu_mib") is not None else "-"
            acc = f"{row['accuracy']:.4f}" if row.get("accuracy") is not None else "-"
            note = ""
            if variant == "batched" and res["k"].get("k_values"):
                k = res["k"]
                free = f" of {k['free_bytes'] / gib:.1f} GiB free" if k.get("free_bytes") is not None else ""
                budget = (
                    f" (budget {k['budget_bytes'] / gib:.1f} GiB{free})"
                    if k.get("budget_bytes") is not None
                    else ""
                )
                note = f"K = {'/'.join(map(str, k['k_values']))}{budget}"
            if variant == "loop" and res["loop_clients"] < args.clients:
                measured = statistics.median(
                    r["measured_s_per_round"] for r in row["runs"] if "measured_s_per_round" in r
                )
                note = (
                    f"ran {res['loop_clients']} of {args.clients} clients ({res['loop_examples']} examples) in "
                    f"{measured:.3f} s/round; scaled x{res['loop_scale']:.2f} by examples"
                )
            timed_out = sum(1 for r in row["runs"] if r.get("timed_out"))
            if timed_out:
                note += f"{'; ' if note else ''}{timed_out} run(s) timed out: their rounds done so far"
            rss = f"{row['peak_rss_mib']:.0f}" if row.get("peak_rss_mib") else "-"
            log(
                f"{model:<6}{variant:<9}{row['s_per_round']:>9.3f}{row['clients_per_s']:>11.1f}{gpu:>14}{rss:>14}{acc:>10}  {note}"
            )
        ratio = res["ratio_batched_over_loop"]
        shown = f"{ratio:.2f}x" if ratio is not None else "n/a"
        verdict = "n/a" if res["ratio_met"] is None else "met" if res["ratio_met"] else "NOT met"
        log(f"{'':<6}batched/loop {shown} (goal >= {GOAL_RATIO:.0f}x: {verdict})")
        if res["goal_updates_per_s"]:
            verdict = (
                "n/a"
                if res["updates_per_s_met"] is None
                else "met"
                if res["updates_per_s_met"]
                else "NOT met"
            )
            log(f"{'':<6}client updates/s, batched: goal >= {GOAL_MLP_UPDATES_PER_S:.0f}: {verdict}")
        if res["accuracy_spread_points"] is not None:
            log(
                f"{'':<6}accuracy spread (batched vs loop, every run): {res['accuracy_spread_points']:.2f} points"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_work_arguments(parser, clients=1000, rounds=3, repeats=1)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument(
        "--loop-clients", type=int, default=0, help="clients the loop trains, scaled by examples (0: all)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=480.0, help="seconds the whole measurement may take"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take at most")
    parser.add_argument("--data-dir", type=Path, default=default_data_dir())
    parser.add_argument("--out", type=Path, default=HERE / "results" / "simulation_gpu.json")
    args = parser.parse_args(argv)
    check_work_arguments(parser, args)
    args.malloc_tunables = False  # run_variant's option; fedgrid sets its own heap tuning
    if not (args.data_dir / "train-images-idx3-ubyte.gz").exists():
        parser.error(f"--data-dir {args.data_dir}: no Fashion-MNIST train-images-idx3-ubyte.gz there")
    try:
        importlib.import_module("fedgrid.simulation.run")  # every worker needs it: fail once, here
    except ImportError as exc:
        parser.error(f"fedgrid is not importable ({exc}): pip install --no-deps -e . and its dependencies")

    started, lines = time.monotonic(), []
    budget = Budget(deadline=started + args.budget_s, runs_left=2 * args.repeats * len(args.models))

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    work_ctx = tempfile.TemporaryDirectory(prefix="fedgrid-simgpu-") if args.work_dir is None else None
    work = Path(work_ctx.name) if work_ctx else args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    log(
        f"GPU simulation benchmark: {args.clients} clients, {args.rounds} rounds ({args.warmup} warm-up), device {args.device}, "
        f"{args.threads} torch threads, {os.cpu_count()} CPUs, budget {args.budget_s:.0f} s"
    )
    shared = prepare(args, work, log)
    results = {model: measure_model(args, work, model, shared, budget, log) for model in args.models}
    log_results(args, results, log)
    log(f"\n{time.monotonic() - started:.0f} s in all")
    gpu = next((r["gpu"] for r in results.values() if r.get("gpu")), None)
    write_results(
        args, {}, {"gpu": gpu}, {"results": results, "table": lines, "wall_s": time.monotonic() - started}
    )
    if work_ctx:
        work_ctx.cleanup()


if __name__ == "__main__":
    main()
