"""A strategy of your own, run in simulation and deployed behind a coordinator, unchanged.

``ServerLRAvg`` subclasses ``fedgrid.Strategy`` (``aggregation/base.py``) directly: each
round it samples a seeded fraction of the live clients, sends them a learning rate that
decays with the round, and moves the global model a step of ``server_lr`` towards the
example-weighted mean of what they sent back (``server_lr = 1`` is FedAvg). Failed clients
arrive as data (``failures``) and are counted, not raised. ``state_dict`` holds all it needs,
so a coordinator restarted with ``--state-dir`` would resume it exactly.

Run: ``python examples/custom_strategy.py [--rounds 10] [--clients 10]``: ``main`` below drives
fedgrid's round engine and in-process fleet on the built-in digits clients (scikit-learn's
digits, no files), with the built-in server-side evaluation. Prints one line per round
(accuracy, loss, clients) and last ``final accuracy A`` (0.86 after the default 10 rounds).

Deployed, ``--strategy MODULE:CLASS`` names it (from the folder holding ``examples/``); the
coordinator builds it with the run's ``seed`` and ``fraction_fit`` (and ``--server-lr``: every
parameter the constructor names), the clients need nothing of it::

    fedgrid coordinator --strategy examples.custom_strategy:ServerLRAvg --rounds 10 --min-clients 3
    fedgrid client --coordinator 127.0.0.1:50051 --partition 0/3      # and 1/3, 2/3, each in its own shell
    # the same run in one process, ending on the deployment's model bit for bit:
    fedgrid simulate --strategy examples.custom_strategy:ServerLRAvg --clients 3 --engine sequential --threads 1

(give the coordinator and clients ``--threads 1`` too for the same bits), or from Python,
``fedgrid.run_coordinator(config, strategy=ServerLRAvg(server_lr=0.5), initial=...)``.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Mapping, Sequence

import numpy as np

from fedgrid import ModelState, Strategy
from fedgrid.types import ClientInfo, Failure, FitIns, FitRes


class ServerLRAvg(Strategy):
    """FedAvg with a server learning rate and a decaying client learning rate.

    Args:
        server_lr: step towards the clients' mean (1: FedAvg; below 1: damped).
        fraction_fit: share of live clients sampled each round (at least one).
        client_lr: the clients' learning rate in round 1, times ``decay`` every round after.
        decay: per-round factor of the clients' learning rate.
        seed: the sampling seed.
    """

    def __init__(self, *, server_lr: float = 1.0, fraction_fit: float = 0.5, client_lr: float = 0.1, decay: float = 0.95,
                 seed: int = 0) -> None:
        if not 0.0 < server_lr <= 2.0 or not 0.0 < fraction_fit <= 1.0:
            raise ValueError(f"server_lr must be in (0, 2] and fraction_fit in (0, 1], got {server_lr} and {fraction_fit}")
        self.server_lr, self.fraction_fit, self.client_lr, self.decay, self.seed = server_lr, fraction_fit, client_lr, decay, seed
        self._global: ModelState = OrderedDict()
        self.failed_total = 0

    def initialize(self, *, initial_state: ModelState) -> None:
        self._global = OrderedDict((k, v.clone()) for k, v in initial_state.items())

    @property
    def global_state(self) -> ModelState:
        return self._global

    def configure_round(self, *, server_round: int, clients: Sequence[ClientInfo]) -> list[tuple[ClientInfo, FitIns]]:
        # Sorted first: the same seed picks the same clients whatever order they joined in.
        ordered = sorted(clients, key=lambda c: c.sort_key)
        count = max(1, round(self.fraction_fit * len(ordered)))
        picked = np.random.default_rng([self.seed, server_round]).choice(len(ordered), size=count, replace=False)
        ins = FitIns(round=server_round, config={"lr": self.client_lr * self.decay ** (server_round - 1), "local_epochs": 1})
        return [(ordered[i], ins) for i in sorted(picked)]

    def aggregate(self, *, server_round: int, results: Sequence[FitRes], failures: Sequence[Failure]) -> dict[str, float]:
        self.failed_total += len(failures)
        if not results:
            return {"failed_total": float(self.failed_total)}  # nothing arrived: keep the model
        results = sorted(results, key=lambda r: r.client.sort_key)  # canonical order: the same bits in any arrival order
        total = sum(r.num_examples for r in results)
        for name, current in self._global.items():
            if not current.is_floating_point():
                continue  # counters and integer buffers stay as they are
            mean = sum(r.state[name] * (r.num_examples / total) for r in results)
            self._global[name] = current + self.server_lr * (mean - current)
        train_loss = sum(r.metrics.get("loss", 0.0) * r.num_examples for r in results) / total
        return {"train_loss": train_loss, "failed_total": float(self.failed_total)}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "failed_total": self.failed_total}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._global = OrderedDict((k, v.clone()) for k, v in state["global_state"].items())
        self.failed_total = int(state["failed_total"])


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description="A custom strategy (ServerLRAvg) on simulated digits clients.", allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--server-lr", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # Imported here: a coordinator that loads ServerLRAvg imports no simulation or dataset code.
    from fedgrid.server.engine import RoundEngine
    from fedgrid.server.parts import RunIO, Schedule
    from fedgrid.simulation.fleet import InProcessFleet
    from fedgrid.simulation.tasks import ClientOptions, resolve

    task = resolve(dataset="digits", seed=args.seed)  # initial model, server-side evaluation, client factory
    strategy = ServerLRAvg(server_lr=args.server_lr, seed=args.seed)
    strategy.initialize(initial_state=task.initial_state)
    cpu = ClientOptions(device="cpu")
    clients = [task.client_factory(i, args.clients, args.seed, cpu) for i in range(args.clients)]
    engine = RoundEngine(
        strategy=strategy, fleet=InProcessFleet(clients),
        schedule=Schedule(rounds=args.rounds, min_clients=1, round_timeout=timedelta(minutes=5),
                          join_timeout=timedelta(seconds=5)),
        io=RunIO(evaluate_fn=task.evaluate,
                 on_round=lambda m: print(f"round {m.round:3d}: accuracy {m.accuracy:.4f} loss {m.loss:.4f} "
                                          f"{m.clients_ok} clients ok, {m.clients_failed} failed", flush=True)),
    )
    final = engine.run()
    assert final is not None
    accuracy = engine.history[-1].accuracy
    assert accuracy is not None
    print(f"final accuracy {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
