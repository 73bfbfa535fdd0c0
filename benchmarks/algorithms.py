"""Training algorithms on Fashion-MNIST: rounds to a target accuracy, block-coordinate bytes,
robust aggregation under attack.

Every run is a federated simulation through fedgrid's own round engine, strategies and
wire serialization (``InProcessFleet``): ``--clients`` clients (default 100) with
Dirichlet(``--alpha``, default 0.3) label skew over the 60k training images, ``--per-round``
of them (default 10) sampled each round, the same small CNN for all, accuracy on the 10k
test images after every round. Three sections (``--sections``):

- ``rounds``: rounds until the test accuracy first reaches ``--target`` (default 0.80) for
  fedavg, fedavgm, fedadam, fedprox, scaffold (at most ``--max-rounds``).
- ``bcd``: test accuracy against cumulative uploaded bytes for ``bcd`` (``--blocks``
  blocks) next to fedavg, ``--bcd-rounds`` rounds each.
- ``robust``: final accuracy after ``--robust-rounds`` rounds of mean, median, trimmed-mean
  (beta 0.3), krum (f 3) with 10/20/30% of the clients attacking, for each attack (sign
  flip x4, Gaussian std 1, label flip); the table shows the worst case over attacks.

    python benchmarks/algorithms.py                       # everything (long on 2 CPU cores)
    python benchmarks/algorithms.py --sections rounds --max-rounds 40 --out /tmp/alg.json

Results go to ``benchmarks/results/algorithms.json``: configuration, environment, and
every round's accuracy and bytes of every run.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid.client.api import Client, FitOutput
from fedgrid.client.torch_client import TorchClient
from fedgrid.config import load_config
from fedgrid.seeding import derive_seed
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import RunIO, Schedule
from fedgrid.server.strategies import build_strategy
from fedgrid.simulation.datasets import Dataset, load_fashion_mnist, partition_dirichlet
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.simulation.tasks import initial_state
from fedgrid.types import FitIns, ModelState, RoundMetrics

__all__ = ["main", "cnn", "Federation"]

ROUNDS_STRATEGIES: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedavgm": {"server_momentum": 0.9, "server_lr": 1.0},
    "fedadam": {"server_lr": 0.01},
    "fedprox": {"proximal_mu": 0.01},
    "scaffold": {},
}
AGGREGATORS: dict[str, dict[str, Any]] = {
    "mean": {},
    "median": {"aggregator": "median"},
    "trimmed-mean": {"aggregator": "trimmed-mean", "aggregator_beta": 0.3},
    "krum": {"aggregator": "krum", "aggregator_f": 3},
}
ATTACKS = ("sign-flip", "gaussian", "label-flip")
FRACTIONS = (0.1, 0.2, 0.3)


def cnn() -> nn.Module:
    """The CNN every run trains: two 3x3 conv layers (8, 16 channels) with max-pooling, then 784 -> 64 -> 10."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 7 * 7, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


class PoisonedModel(Client):
    """A Byzantine client: trains honestly, sends ``global - 4 * update`` (sign flip) or
    ``global + N(0, 1)`` (Gaussian) instead."""

    def __init__(self, inner: Client, attack: str) -> None:
        self.inner, self.attack = inner, attack
        self.name, self.region = inner.name, inner.region

    @property
    def num_examples(self) -> int:
        return self.inner.num_examples

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        out = self.inner.fit(state, ins)
        gen = torch.Generator().manual_seed(derive_seed("attack", ins.round, self.name))
        sent: ModelState = OrderedDict()
        for name, t in out.state.items():
            if not t.is_floating_point() or name not in state:
                sent[name] = t
            elif self.attack == "sign-flip":
                sent[name] = state[name] - 4.0 * (t - state[name])
            else:
                sent[name] = state[name] + torch.randn(t.shape, generator=gen, dtype=t.dtype)
        return FitOutput(sent, out.num_examples, out.metrics)


class Federation:
    """The data split and clients of every run (built once; clients are rebuilt per run).

    Args:
        data: Fashion-MNIST.
        num_clients: clients; partition ``i`` is client ``i``'s.
        alpha: Dirichlet label-skew parameter.
        seed: seeds the split, the model and sampling.
        lr: client SGD learning rate (momentum 0.9, batch 32).
    """

    def __init__(self, data: Dataset, *, num_clients: int, alpha: float, seed: int, lr: float) -> None:
        self.data, self.num_clients, self.seed, self.lr = data, num_clients, seed, lr
        self.parts = partition_dirichlet(data.y_train.numpy(), num_clients, alpha, seed)
        self.initial = initial_state(cnn, seed)

    def client(self, index: int, *, flip_labels: bool = False) -> TorchClient:
        idx = torch.from_numpy(self.parts[index])
        labels = self.data.y_train[idx]
        if flip_labels:
            labels = 9 - labels
        return TorchClient(
            cnn(),
            DataLoader(TensorDataset(self.data.x_train[idx], labels), batch_size=32, shuffle=True),
            nn.functional.cross_entropy,
            lambda params: torch.optim.SGD(params, lr=self.lr, momentum=0.9),
            device="cpu",
            seed=self.seed,
            name=f"fmnist-{index:04d}",
        )

    @torch.no_grad()
    def evaluate(self, state: ModelState) -> tuple[float, dict[str, float]]:
        model = cnn()
        model.load_state_dict(state)
        model.eval()
        loss, correct = 0.0, 0
        for start in range(0, len(self.data.y_test), 2000):
            x, y = self.data.x_test[start : start + 2000], self.data.y_test[start : start + 2000]
            out = model(x)
            loss += float(nn.functional.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
        n = len(self.data.y_test)
        return loss / n, {"accuracy": correct / n}

    def run(
        self,
        strategy: str,
        options: Mapping[str, Any],
        *,
        rounds: int,
        per_round: int,
        attackers: Mapping[int, str] | None = None,
        stop_at: float | None = None,
    ) -> list[RoundMetrics]:
        """Runs up to ``rounds`` rounds (stops after the first at ``stop_at`` accuracy)."""
        config = load_config(
            overrides={
                "strategy": strategy,
                "clients": self.num_clients,
                "rounds": rounds,
                "seed": self.seed,
                "lr": self.lr,
                "local_epochs": 1,
                "fraction_fit": per_round / self.num_clients,
                **options,
            }
        )
        built = build_strategy(config, num_clients=self.num_clients)
        built.initialize(initial_state=self.initial)
        attackers = attackers or {}
        clients: list[Client] = []
        for i in range(self.num_clients):
            attack = attackers.get(i)
            honest = self.client(i, flip_labels=attack == "label-flip")
            clients.append(PoisonedModel(honest, attack) if attack in ("sign-flip", "gaussian") else honest)
        engine = RoundEngine(
            strategy=built,
            fleet=InProcessFleet(clients),
            schedule=Schedule(
                rounds=rounds,
                min_clients=1,
                round_timeout=timedelta(hours=1),
                join_timeout=timedelta(seconds=1),
            ),
            io=RunIO(
                evaluate_fn=self.evaluate,
            ),
        )
        history = []
        for r in range(1, rounds + 1):
            history.append(engine.run_round(r))
            if stop_at is not None and (history[-1].accuracy or 0.0) >= stop_at:
                break
        return history


def _summary(history: list[RoundMetrics]) -> list[dict[str, Any]]:
    return [
        {
            "round": m.round,
            "accuracy": m.accuracy,
            "bytes_up": m.bytes_up,
            "bytes_down": m.bytes_down,
            "wall_s": m.wall_s,
        }
        for m in history
    ]


def section_rounds(fed: Federation, args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    log(f"\nrounds to {args.target:.0%} test accuracy (at most {args.max_rounds})")
    log(f"{'strategy':<12}{'rounds':>8}{'best acc':>10}{'MB up':>10}{'s/round':>9}")
    for name, options in ROUNDS_STRATEGIES.items():
        h = fed.run(name, options, rounds=args.max_rounds, per_round=args.per_round, stop_at=args.target)
        reached = h[-1].round if (h[-1].accuracy or 0) >= args.target else None
        out[name] = {"options": options, "rounds_to_target": reached, "history": _summary(h)}
        best = max(m.accuracy or 0.0 for m in h)
        shown = str(reached) if reached else f">{args.max_rounds}"
        log(
            f"{name:<12}{shown:>8}{best:>10.3f}{sum(m.bytes_up for m in h) / 1e6:>10.1f}{sum(m.wall_s for m in h) / len(h):>9.1f}"
        )
    return out


def section_bcd(fed: Federation, args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    runs = {
        "fedavg": fed.run("fedavg", {}, rounds=args.bcd_rounds, per_round=args.per_round),
        f"bcd-{args.blocks}": fed.run(
            "bcd", {"num_blocks": args.blocks}, rounds=args.bcd_rounds, per_round=args.per_round
        ),
    }
    log(f"\naccuracy against cumulative upload (MB): fedavg vs bcd with {args.blocks} blocks")
    log(f"{'round':>6}" + "".join(f"{name + ' MB':>14}{name + ' acc':>14}" for name in runs))
    cumulative = {name: 0 for name in runs}
    for i in range(args.bcd_rounds):
        row = f"{i + 1:>6}"
        for name, h in runs.items():
            cumulative[name] += h[i].bytes_up
            row += f"{cumulative[name] / 1e6:>14.2f}{h[i].accuracy:>14.3f}"
        if (i + 1) % max(1, args.bcd_rounds // 10) == 0 or i == 0:
            log(row)
    for level in (0.6, 0.7, 0.75, 0.8):
        cells = []
        for name, h in runs.items():
            total, hit = 0, None
            for m in h:
                total += m.bytes_up
                if (m.accuracy or 0) >= level:
                    hit = total
                    break
            cells.append(f"{name} {hit / 1e6:.2f} MB" if hit else f"{name} not reached")
        log(f"upload to reach {level:.0%}: " + ", ".join(cells))
    return {name: _summary(h) for name, h in runs.items()}


def section_robust(fed: Federation, args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    out: dict[str, Any] = {"clean": {}, "attacked": {}}
    rng = random.Random(derive_seed("attackers", fed.seed))
    order = rng.sample(range(fed.num_clients), fed.num_clients)
    log(
        f"\nrobust aggregation: test accuracy after {args.robust_rounds} rounds, worst case over {', '.join(ATTACKS)}"
    )
    log(
        f"{'aggregator':<14}{'clean':>8}"
        + "".join(f"{f'{int(f * 100)}% worst':>12}" for f in FRACTIONS)
        + "  (worst attack)"
    )
    for agg in args.aggregators.split(","):
        options = AGGREGATORS[agg]
        clean = (
            fed.run("fedavg", options, rounds=args.robust_rounds, per_round=args.per_round)[-1].accuracy
            or 0.0
        )
        out["clean"][agg] = clean
        cells, worst_names = [], []
        for fraction in FRACTIONS:
            bad = order[: round(fraction * fed.num_clients)]
            results = {}
            for attack in ATTACKS:
                h = fed.run(
                    "fedavg",
                    options,
                    rounds=args.robust_rounds,
                    per_round=args.per_round,
                    attackers={i: attack for i in bad},
                )
                results[attack] = h[-1].accuracy or 0.0
                out["attacked"][f"{agg}/{attack}/{fraction}"] = results[attack]
            worst = min(results, key=lambda a: results[a])
            cells.append(f"{results[worst]:>12.3f}")
            worst_names.append(worst)
        log(f"{agg:<14}{clean:>8.3f}" + "".join(cells) + "  (" + ", ".join(worst_names) + ")")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "fashion-mnist")
    )
    parser.add_argument("--sections", default="rounds,bcd,robust")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.3)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.80)
    parser.add_argument("--max-rounds", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--bcd-rounds", type=int, default=60)
    parser.add_argument("--robust-rounds", type=int, default=30)
    parser.add_argument(
        "--aggregators", default=",".join(AGGREGATORS), help="robust section: which aggregators"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "algorithms.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.monotonic()
    fed = Federation(
        load_fashion_mnist(args.data), num_clients=args.clients, alpha=args.alpha, seed=args.seed, lr=args.lr
    )
    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    sections = {"rounds": section_rounds, "bcd": section_bcd, "robust": section_robust}
    results = {name: sections[name](fed, args, log) for name in args.sections.split(",") if name}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()}
    payload = {
        "config": {k: v for k, v in vars(args).items()},
        "environment": env,
        "results": results,
        "table": lines,
        "wall_s": time.monotonic() - start,
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out} ({time.monotonic() - start:.0f}s)")


if __name__ == "__main__":
    main()
