"""Why ``topk`` at 50x loses accuracy under FedAvg on Fashion-MNIST (issue 29): a diagnosis.

The clients, data split and CNN of ``benchmarks/compression.py`` (100 clients, Dirichlet 0.3,
10 per round, SGD lr 0.02 momentum 0.9, one local epoch), in a plain loop (no round engine:
the point is the arithmetic of one round, not the wire). Two sections (``--sections``):

- ``shrinkage``: along an uncompressed FedAvg run (``--diag-rounds`` rounds), per round, how
  the mean of the clients' decoded updates ``m^ = mean_i D(C(d_i))`` compares with the mean
  update ``m = mean_i d_i`` (example-weighted, as FedAvg): the norm ratio ``|m^| / |m|``, the
  cosine, and the projection ``<m^, m> / |m|^2`` (how far the round moves along ``m``: 1 for
  ``none``), for each codec of ``--codecs``, and their means over the rounds; and per tensor
  the share of each client's energy that top-k keeps.
- ``ef21``: 30 rounds (``--rounds``) of FedAvg where each client uploads top-k
  (``--fraction``) under EF21 (Richtarik et al. 2021): client and server keep an estimate
  ``g_i``, the client sends ``topk(d_i - g_i)``, both add it to ``g_i``; the server applies
  the mean of the round's ``g_i`` (``ef21``) or of every ``g_i`` it holds, stale ones too
  (``ef21-pp``, Fatkhullin et al. 2021, as MIFA); ``none`` in the same loop for comparison.
  A prototype of the arithmetic only, to decide whether building it into the strategy pays.

    python benchmarks/topk_diagnosis.py --threads 1                      # both, about 5 minutes
    python benchmarks/topk_diagnosis.py --sections shrinkage --diag-rounds 3
    python benchmarks/topk_diagnosis.py --sections shrinkage --diag-rounds 30 --codecs topk:0.013:scaled,topk:0.04:scaled,sparseloco:240:scaled,sign,powersgd:4,int8

Results go to ``benchmarks/results/topk_diagnosis.json`` (the printed lines and every number).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fedgrid.compression import get_codec  # noqa: E402
from fedgrid.simulation.datasets import load_fashion_mnist  # noqa: E402
from fedgrid.types import FitIns, ModelState  # noqa: E402

from algorithms import Federation  # noqa: E402  (benchmarks/ is not a package)

__all__ = ["main", "round_deltas", "compare", "run_ef21"]


def round_deltas(
    fed: Federation, state: ModelState, clients: list[int], rnd: int
) -> list[tuple[float, ModelState]]:
    """``(examples, d_i)`` of each client trained one local epoch from ``state``."""
    out = []
    for i in clients:
        start = OrderedDict((k, v.clone()) for k, v in state.items())
        fit = fed.client(i).fit(start, FitIns(round=rnd, config={"local_epochs": 1, "lr": fed.lr}))
        out.append(
            (float(fit.num_examples), OrderedDict((k, fit.state[k].float() - state[k]) for k in state))
        )
    return out


def _codec_apply(spec: str) -> Callable[[torch.Tensor], torch.Tensor]:
    codec = get_codec(spec)
    return lambda x: codec.decode(codec.encode(x), dtype=x.dtype, shape=tuple(x.shape))


def _mean(weighted: list[tuple[float, ModelState]]) -> ModelState:
    total = sum(w for w, _ in weighted)
    keys = weighted[0][1].keys()
    return OrderedDict((k, sum(w * d[k] for w, d in weighted) / total) for k in keys)


def _flat(state: ModelState) -> torch.Tensor:
    return torch.cat([v.reshape(-1).double() for v in state.values()])


def compare(deltas: list[tuple[float, ModelState]], spec: str) -> dict[str, float]:
    """Norm ratio, cosine and projection of the mean decoded update against the mean update."""
    apply = _codec_apply(spec)
    m = _flat(_mean(deltas))
    m_hat = _flat(_mean([(w, OrderedDict((k, apply(v)) for k, v in d.items())) for w, d in deltas]))
    return {
        "norm_ratio": float(m_hat.norm() / m.norm()),
        "cosine": float(m_hat @ m / (m_hat.norm() * m.norm())),
        "projection": float(m_hat @ m / (m @ m)),
    }


def shrinkage(fed: Federation, args: argparse.Namespace, log: Callable[[str], None]) -> list[dict[str, Any]]:
    rng = np.random.default_rng(args.seed)
    state = OrderedDict((k, v.clone()) for k, v in fed.initial.items())
    topk = _codec_apply(f"topk:{args.fraction!r}")
    rows = []
    for rnd in range(1, args.diag_rounds + 1):
        deltas = round_deltas(
            fed, state, [int(i) for i in rng.choice(fed.num_clients, args.per_round, False)], rnd
        )
        row: dict[str, Any] = {
            "round": rnd,
            "codecs": {s: compare(deltas, s) for s in args.codecs.split(",")},
        }
        row["energy_kept"] = {
            k: float(
                np.mean(
                    [
                        float(topk(d[k]).double().square().sum() / d[k].double().square().sum())
                        for _, d in deltas
                    ]
                )
            )
            for k in state
        }
        rows.append(row)
        for spec, c in row["codecs"].items():
            log(f"{rnd:>5}  {spec:<22}{c['norm_ratio']:>8.3f}{c['cosine']:>8.3f}{c['projection']:>8.3f}")
        log(
            "       top-k energy kept per tensor: "
            + ", ".join(f"{k} {v:.2f}" for k, v in row["energy_kept"].items())
        )
        state = OrderedDict((k, state[k] + v) for k, v in _mean(deltas).items())
    log(f"mean over rounds 1-{args.diag_rounds}:")
    for spec in args.codecs.split(","):
        means = {
            key: float(np.mean([r["codecs"][spec][key] for r in rows]))
            for key in ("norm_ratio", "cosine", "projection")
        }
        log(f"  all  {spec:<22}{means['norm_ratio']:>8.3f}{means['cosine']:>8.3f}{means['projection']:>8.3f}")
    return rows


def run_ef21(fed: Federation, mode: str, args: argparse.Namespace, log: Callable[[str], None]) -> list[float]:
    """Accuracy after each round of FedAvg under ``mode``: ``none``, ``ef21`` or ``ef21-pp``."""
    rng = np.random.default_rng(args.seed)
    state = OrderedDict((k, v.clone()) for k, v in fed.initial.items())
    topk = _codec_apply(f"topk:{args.fraction!r}")
    estimates: dict[int, tuple[float, ModelState]] = {}
    accuracy = []
    for rnd in range(1, args.rounds + 1):
        clients = [int(i) for i in rng.choice(fed.num_clients, args.per_round, False)]
        deltas = round_deltas(fed, state, clients, rnd)
        if mode == "none":
            pool = deltas
        else:
            for i, (w, d) in zip(clients, deltas):
                g = estimates.get(i, (w, OrderedDict((k, torch.zeros_like(v)) for k, v in d.items())))[1]
                estimates[i] = (w, OrderedDict((k, g[k] + topk(d[k] - g[k])) for k in d))
            pool = [estimates[i] for i in clients] if mode == "ef21" else list(estimates.values())
        state = OrderedDict((k, state[k] + v) for k, v in _mean(pool).items())
        accuracy.append(fed.evaluate(state)[1]["accuracy"])
        if rnd % 5 == 0:
            log(f"  {mode:<8} round {rnd:>3}  acc {accuracy[-1]:.4f}")
    return accuracy


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "fashion-mnist")
    )
    parser.add_argument("--sections", default="shrinkage,ef21")
    parser.add_argument(
        "--codecs", default="topk:0.013,topk:0.013:scaled,topk:0.05,sparseloco:240:scaled,int8"
    )
    parser.add_argument(
        "--fraction", type=float, default=0.013, help="top-k fraction of the per-tensor energy and EF21"
    )
    parser.add_argument("--diag-rounds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.3)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "topk_diagnosis.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start, lines = time.monotonic(), []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    fed = Federation(
        load_fashion_mnist(args.data), num_clients=args.clients, alpha=args.alpha, seed=args.seed, lr=args.lr
    )
    result: dict[str, Any] = {"config": vars(args)}
    sections = args.sections.split(",")
    if "shrinkage" in sections:
        log(f"round  {'codec':<22}{'|m^|/|m|':>8}{'cos':>8}{'proj':>8}   (m: mean update, m^: mean decoded)")
        result["shrinkage"] = shrinkage(fed, args, log)
    if "ef21" in sections:
        log(
            f"EF21 with topk:{args.fraction!r}, {args.rounds} rounds, {args.per_round} of {args.clients} per round"
        )
        runs = {mode: run_ef21(fed, mode, args, log) for mode in ("none", "ef21", "ef21-pp")}
        result["ef21"] = runs
        for mode, acc in runs.items():
            log(
                f"{mode:<8} final {acc[-1]:.4f}  last5 {np.mean(acc[-5:]):.4f}  d final {100 * (acc[-1] - runs['none'][-1]):+.2f} pts"
            )
    result["table"], result["wall_s"] = lines, time.monotonic() - start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} ({result['wall_s']:.0f}s)")


if __name__ == "__main__":
    main()
