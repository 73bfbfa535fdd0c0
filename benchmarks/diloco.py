"""DiLoCo and streaming DiLoCo against synchronous data parallel, on Shakespeare next-character prediction.

Every variant trains the same character LSTM (embedding 8, one LSTM layer of 128 units,
linear to the 80-character vocabulary; predicts the next character at every position of
an 80-character window) from the same initial weights with ``--workers`` workers (default
4). Worker ``w`` holds whole speaking roles (``partition_natural`` of the LEAF split) and
every worker runs the same number of optimizer steps ``--steps`` (default 1000) on batches
of ``--batch-size`` (default 32) windows from its own roles, so every variant sees the same
number of training tokens:

- ``dp``: synchronous data parallel, written out here: each step every worker computes
  the gradient of its batch, the gradients are averaged (an all-reduce) and one AdamW step
  is taken on the one model.
- ``diloco``: fedgrid's ``diloco`` strategy through fedgrid's own ``RoundEngine`` and
  ``InProcessFleet`` (the same code as ``fedgrid simulate``; models cross the real wire
  serialization): each round every worker runs H = ``--inner-steps`` (default 50) AdamW
  steps with its inner optimizer kept across rounds, the server applies Nesterov SGD (lr
  0.7, momentum 0.9: the strategy's defaults) to the averaged pseudo-gradient.
- ``streaming``: fedgrid's ``streaming-diloco`` with F = ``--fragments`` (default 5)
  fragments, H / F inner steps per round: one fragment is synced per round, so each
  fragment is synced every H steps, staggered (the paper's schedule).
- ``streaming-long``: the same strategy with H inner steps per round: each fragment is
  synced every F * H steps.
- ``trend``: ``diloco`` at the other H of ``--trend`` (default 10 and 100).

All use AdamW with lr ``--lr`` (default 1e-2, the best of 1e-3, 3e-3, 1e-2 for both data parallel
and DiLoCo in 250-step trials) and torch's default weight decay (0.01).
Reported: the held-out loss (mean cross-entropy over all 80 positions) on a fixed
``--test-windows`` (default 10,000) subset of the test windows, also after every 250 steps
where a round ends there; the LEAF metric (loss and accuracy on the last character); and
the bytes each worker communicates. For fedgrid runs these are the wire bytes the fleet
counts (``RoundMetrics.bytes_up + bytes_down``, protobuf framing included) summed over
rounds and divided by the workers; for ``dp`` the float32 gradient's bytes x 2 (up and
down of an all-reduce) x steps.

    .venv/bin/python benchmarks/diloco.py                        # about 20 minutes on a shared 2-core VM
    .venv/bin/python benchmarks/diloco.py --steps 200 --variants dp,diloco --out /tmp/d.json

Results go to ``benchmarks/results/diloco.json``: configuration, environment, and per
variant its curve, bytes and every round's wire bytes and training loss.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from fedgrid.aggregation.diloco import DiLoCo, StreamingDiLoCo
from fedgrid.client.torch_client import TorchClient
from fedgrid.config import load_config
from fedgrid.seeding import derive_seed
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import Schedule
from fedgrid.server.strategies import build_strategy
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.simulation.shakespeare import CharData, NextChars, load_shakespeare, partition_natural
from fedgrid.simulation.tasks import initial_state
from fedgrid.types import RoundMetrics

__all__ = ["main", "CharLSTM", "Bench"]

DEFAULT_DATA = "/work/shared/data/shakespeare"
VARIANTS = ("dp", "diloco", "streaming", "streaming-long", "trend")
CURVE_EVERY = 250  # steps between held-out evaluations (where a round ends there)


class CharLSTM(nn.Module):
    """Embedding 8 -> LSTM(128) -> linear to the vocabulary, a prediction at every position."""

    def __init__(self, vocab: int = 80, embed: int = 8, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x))
        return self.head(out)  # [batch, seq_len, vocab]


def seq_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Bench:
    """The data split, the initial model and the test subset shared by every variant.

    Args:
        data: Shakespeare.
        workers: workers; worker ``w`` holds the roles ``partition_natural`` deals it.
        batch_size: windows per step and worker.
        lr: AdamW learning rate (inner optimizer, and data parallel's).
        seed: model initialization, shuffling, the test subset.
        test_windows: size of the fixed held-out subset.
    """

    def __init__(
        self, data: CharData, *, workers: int, batch_size: int, lr: float, seed: int, test_windows: int
    ) -> None:
        self.data, self.workers, self.batch_size, self.lr, self.seed = data, workers, batch_size, lr, seed
        self.parts = partition_natural(data.train_roles, workers)
        self.initial = initial_state(CharLSTM, seed)
        self.param_bytes = sum(t.numel() * t.element_size() for t in self.initial.values())
        n_test = len(data.test_starts)
        pick = np.sort(
            np.random.default_rng(seed).choice(n_test, size=min(test_windows, n_test), replace=False)
        )
        test = NextChars(data.text, data.test_starts[torch.from_numpy(pick)], data.seq_len)
        self.test_x = torch.stack([test[i][0] for i in range(len(test))])
        self.test_y = torch.stack([test[i][1] for i in range(len(test))])

    def loader(self, worker: int, *, generator: torch.Generator | None = None) -> DataLoader:
        starts = self.data.train_starts[torch.from_numpy(self.parts[worker])]
        return DataLoader(
            NextChars(self.data.text, starts, self.data.seq_len),
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            generator=generator,
        )

    @torch.no_grad()
    def evaluate(self, state: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Held-out loss over all positions, and LEAF's last-character loss and accuracy."""
        model = CharLSTM()
        model.load_state_dict(state)
        model.eval()
        total = last = correct = 0.0
        for i in range(0, len(self.test_y), 1000):
            x, y = self.test_x[i : i + 1000], self.test_y[i : i + 1000]
            out = model(x)
            total += float(
                nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")
            )
            last += float(nn.functional.cross_entropy(out[:, -1], y[:, -1], reduction="sum"))
            correct += float((out[:, -1].argmax(-1) == y[:, -1]).sum())
        n = len(self.test_y)
        return {
            "loss": total / (n * y.shape[1]),
            "last_char_loss": last / n,
            "last_char_accuracy": correct / n,
        }

    def run_fedgrid(
        self, strategy: str, *, inner_steps: int, steps: int, num_fragments: int | None = None
    ) -> dict[str, Any]:
        """``steps // inner_steps`` rounds of ``strategy`` through fedgrid's engine."""
        rounds = steps // inner_steps
        config = load_config(
            overrides={
                "strategy": strategy,
                "clients": self.workers,
                "rounds": rounds,
                "seed": self.seed,
                "inner_lr": self.lr,
                "local_epochs": 1,
                "fraction_fit": 1.0,
                "inner_steps": inner_steps,
                "num_fragments": num_fragments,
            }
        )
        built = build_strategy(config, num_clients=self.workers)
        built.initialize(initial_state=self.initial)
        clients = [
            TorchClient(
                CharLSTM(),
                self.loader(w),
                seq_loss,
                lambda params: torch.optim.AdamW(params, lr=self.lr),
                inner_optimizer=lambda params: torch.optim.AdamW(params, lr=self.lr),
                device="cpu",
                seed=self.seed,
                name=f"worker-{w}",
            )
            for w in range(self.workers)
        ]
        engine = RoundEngine(
            strategy=built,
            fleet=InProcessFleet(clients),
            schedule=Schedule(
                rounds=rounds,
                min_clients=self.workers,
                round_timeout=timedelta(hours=1),
                join_timeout=timedelta(seconds=1),
            ),
        )
        history: list[RoundMetrics] = []
        curve = []
        start = time.monotonic()
        for r in range(1, rounds + 1):
            history.append(engine.run_round(r))
            done = r * inner_steps
            if done % CURVE_EVERY == 0 or r == rounds:
                curve.append({"steps": done, **self.evaluate(built.global_state)})
        wall = time.monotonic() - start
        assert isinstance(built, DiLoCo)
        opt = built.server_optimizer
        up = sum(m.bytes_up for m in history) / self.workers
        down = sum(m.bytes_down for m in history) / self.workers
        out: dict[str, Any] = {
            "strategy": strategy,
            "inner_steps": inner_steps,
            "rounds": rounds,
            "steps": rounds * inner_steps,
            "outer_lr": getattr(opt, "lr", None),
            "outer_momentum": getattr(opt, "momentum", None),
            "bytes_up_per_worker": up,
            "bytes_down_per_worker": down,
            "bytes_per_worker": up + down,
            "wall_s": wall,
            "curve": curve,
            "final": curve[-1],
            "rounds_detail": [
                {
                    "round": m.round,
                    "bytes_up": m.bytes_up,
                    "bytes_down": m.bytes_down,
                    "train_loss": m.extra.get("train_loss", m.loss),
                    "clients_ok": m.clients_ok,
                }
                for m in history
            ],
        }
        if isinstance(built, StreamingDiLoCo):
            out["num_fragments"] = built.num_fragments
            out["fragments"] = [{"prefixes": list(f.prefixes), "numel": f.numel} for f in built.fragments]
            out["sync_period_steps"] = built.num_fragments * inner_steps
        else:
            out["sync_period_steps"] = inner_steps
        return out

    def run_dp(self, *, steps: int) -> dict[str, Any]:
        """Synchronous data parallel: per step, the mean of the workers' gradients, one AdamW step."""
        model = CharLSTM()
        model.load_state_dict(self.initial)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr)
        streams = [
            self._cycle(
                self.loader(w, generator=torch.Generator().manual_seed(derive_seed("dp", self.seed, w)))
            )
            for w in range(self.workers)
        ]
        curve = []
        start = time.monotonic()
        for step in range(1, steps + 1):
            optimizer.zero_grad(set_to_none=True)
            for stream in streams:  # summing loss / workers over backward passes = averaging the gradients
                x, y = next(stream)
                (seq_loss(model(x), y) / self.workers).backward()
            optimizer.step()
            if step % CURVE_EVERY == 0 or step == steps:
                curve.append({"steps": step, **self.evaluate(model.state_dict())})
        wall = time.monotonic() - start
        per_worker = 2.0 * self.param_bytes * steps
        return {
            "strategy": "data-parallel",
            "inner_steps": 1,
            "rounds": steps,
            "steps": steps,
            "sync_period_steps": 1,
            "bytes_up_per_worker": per_worker / 2,
            "bytes_down_per_worker": per_worker / 2,
            "bytes_per_worker": per_worker,
            "wall_s": wall,
            "curve": curve,
            "final": curve[-1],
        }

    @staticmethod
    def _cycle(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from loader


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data-dir", default=DEFAULT_DATA, help="folder holding gutenberg-texts.tar.gz")
    p.add_argument("--workers", type=int, default=4, help="workers (1-8)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps per worker, every variant")
    p.add_argument("--inner-steps", type=int, default=50, help="DiLoCo's H")
    p.add_argument("--fragments", type=int, default=5, help="streaming DiLoCo's F")
    p.add_argument("--trend", default="10,100", help="further H for diloco (comma list; empty: none)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate of every variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--test-windows", type=int, default=10_000)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "diloco.json"))
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown} (known: {', '.join(VARIANTS)})")
    if not 1 <= args.workers <= 8:
        p.error("--workers must be between 1 and 8")
    args.trend = [int(h) for h in args.trend.split(",") if h.strip()]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    torch.set_num_threads(1)

    def log(line: str = "") -> None:
        print(line, flush=True)

    t0 = time.monotonic()
    data = load_shakespeare(args.data_dir)
    bench = Bench(
        data,
        workers=args.workers,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        test_windows=args.test_windows,
    )
    log(
        f"Shakespeare: {len(data.roles)} roles, {len(data.train_starts):,} train / {len(data.test_starts):,} test windows "
        f"(loaded in {time.monotonic() - t0:.1f} s); workers hold {[len(p) for p in bench.parts]} windows"
    )
    log(
        f"model: {bench.param_bytes // 4:,} float32 parameters ({bench.param_bytes:,} bytes); initial held-out loss "
        f"{bench.evaluate(bench.initial)['loss']:.3f}"
    )
    H, F = args.inner_steps, args.fragments
    plan: list[tuple[str, str, dict[str, Any]]] = []  # (label, kind, kwargs)
    if "dp" in args.variants:
        plan.append(("data-parallel", "dp", {}))
    if "diloco" in args.variants:
        plan.append((f"diloco H={H}", "diloco", {"inner_steps": H}))
    if "streaming" in args.variants:
        plan.append(
            (
                f"streaming F={F}, H/F={max(1, round(H / F))}",
                "streaming-diloco",
                {"inner_steps": max(1, round(H / F)), "num_fragments": F},
            )
        )
    if "streaming-long" in args.variants:
        plan.append((f"streaming F={F}, H={H}", "streaming-diloco", {"inner_steps": H, "num_fragments": F}))
    if "trend" in args.variants:
        plan += [(f"diloco H={h}", "diloco", {"inner_steps": h}) for h in args.trend if h != H]
    results: dict[str, dict[str, Any]] = {}
    for label, kind, kwargs in plan:
        log(f"running {label} ...")
        res = (
            bench.run_dp(steps=args.steps)
            if kind == "dp"
            else bench.run_fedgrid(kind, steps=args.steps, **kwargs)
        )
        results[label] = res
        log(
            f"  {res['rounds']} rounds, {res['wall_s']:.0f} s, held-out loss {res['final']['loss']:.4f}, "
            f"{res['bytes_per_worker'] / 1e6:.2f} MB/worker; curve "
            + ", ".join(f"{c['steps']}:{c['loss']:.3f}" for c in res["curve"])
        )
    dp_bytes = results["data-parallel"]["bytes_per_worker"] if "data-parallel" in results else None
    log()
    log(
        f"{args.workers} workers x {args.steps} steps x batch {args.batch_size} (x 80 characters); held-out: {len(bench.test_y):,} test windows"
    )
    header = f"{'variant':<24}{'H/round':>8}{'sync every':>11}{'rounds':>7}{'test loss':>10}{'last-char acc':>14}{'MB/worker':>11}{'up MB':>8}{'down MB':>9}{'vs DP':>8}"
    log(header)
    log("-" * len(header))
    for label, res in results.items():
        ratio = f"{res['bytes_per_worker'] / dp_bytes:.4f}" if dp_bytes else "-"
        log(
            f"{label:<24}{res['inner_steps']:>8}{res['sync_period_steps']:>11}{res['rounds']:>7}{res['final']['loss']:>10.4f}"
            f"{res['final']['last_char_accuracy']:>14.3f}{res['bytes_per_worker'] / 1e6:>11.2f}{res['bytes_up_per_worker'] / 1e6:>8.2f}"
            f"{res['bytes_down_per_worker'] / 1e6:>9.2f}{ratio:>8}"
        )
        if dp_bytes:
            res["bytes_vs_dp"] = res["bytes_per_worker"] / dp_bytes
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "threads": torch.get_num_threads(),
            "argv": sys.argv,
        },
        "data": {
            "roles": len(data.roles),
            "train_windows": len(data.train_starts),
            "test_windows": len(data.test_starts),
            "worker_windows": [len(p) for p in bench.parts],
            "held_out_windows": len(bench.test_y),
        },
        "model": {
            "params": bench.param_bytes // 4,
            "float32_bytes": bench.param_bytes,
            "initial_loss": bench.evaluate(bench.initial)["loss"],
        },
        "variants": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    log(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    main()
