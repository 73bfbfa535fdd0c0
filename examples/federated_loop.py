"""Federate an existing PyTorch training loop: every N steps, hand the model to fedgrid and
continue from the federated average.

The loop below is a plain PyTorch loop (model, optimizer, batches, ``loss.backward()``). It
owns the training; fedgrid only syncs. ``LoopSync`` is the bridge: a ``fedgrid.Client``
that the SDK's runtime drives from its own thread (``fedgrid.start``), and whose ``fit``,
instead of training, hands the round's global model to the loop and waits for the loop's
model after its next N steps. ``evaluate`` (every participant evaluates each new global
model, ``fraction_evaluate = 1``) is how the last round's average reaches the loop.

Two sites (threads here, processes or machines in real life) each train on their own half
of scikit-learn's digits; a coordinator (``fedgrid coordinator``, started in a background
thread) runs FedAvg over them.

Run: ``python examples/federated_loop.py [--rounds 5] [--sync-every 20]``. Prints each sync
(site, step, local loss, how far the average moved the site's model) and the final
federated accuracy.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid import Client, EvaluateOutput, FitIns, FitOutput, ModelState, Scalar, load_config, start
from fedgrid.cli import serve
from fedgrid.simulation.datasets import load_digits, partition_iid


class LoopSync(Client):
    """The bridge between a host training loop and the fedgrid runtime.

    The runtime's thread calls ``fit`` and ``evaluate``; the loop's thread calls ``pull``
    and ``push``. Version ``r`` is the global model after round ``r`` (0: the initial one).

    Args:
        name: the site's name in the federation.
        num_examples: training examples the site holds (its weight in averaging is at most this).
        eval_data: ``(x, y)`` for ``evaluate``.
        timeout_s: longest wait for the other side (a loop that stopped, a federation that did).
    """

    def __init__(self, name: str, num_examples: int, eval_data: tuple[torch.Tensor, torch.Tensor], *, timeout_s: float = 300.0) -> None:
        self.name, self._held, self._eval, self.timeout_s = name, num_examples, eval_data, timeout_s
        self._cond = threading.Condition()
        self._global: tuple[int, ModelState] | None = None  # (version, state)
        self._pushed: dict[int, FitOutput] = {}  # round -> the loop's model for it
        self.model_factory: Any = None  # set by the loop: builds a module to evaluate with

    @property
    def num_examples(self) -> int:
        return self._held

    # -- the runtime's side --------------------------------------------------------------
    def _publish(self, version: int, state: ModelState) -> None:
        with self._cond:
            if self._global is None or version > self._global[0]:
                self._global = (version, OrderedDict((k, v.clone()) for k, v in state.items()))
                self._cond.notify_all()

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        self._publish(ins.round - 1, state)  # round r trains from the model after round r - 1
        with self._cond:
            if not self._cond.wait_for(lambda: ins.round in self._pushed, timeout=self.timeout_s):
                raise TimeoutError(f"{self.name}: the training loop pushed no model for round {ins.round} in {self.timeout_s}s")
            return self._pushed.pop(ins.round)

    @torch.no_grad()
    def evaluate(self, state: ModelState, config: Mapping[str, Scalar]) -> EvaluateOutput:
        if "round" not in config:
            raise ValueError(f"{self.name}: an evaluation task without 'round' cannot be matched to the loop's sync")
        self._publish(int(config["round"]), state)  # FedAvg's strategies evaluate the model after round r
        model = self.model_factory()
        model.load_state_dict(state)
        x, y = self._eval
        logits = model(x)
        return EvaluateOutput(len(y), {"loss": float(nn.functional.cross_entropy(logits, y)),
                                       "accuracy": float((logits.argmax(1) == y).float().mean())})

    # -- the loop's side -----------------------------------------------------------------
    def pull(self, version: int) -> ModelState:
        """Blocks until the global model of ``version`` (or later) is known; returns it.

        Raises:
            TimeoutError: none arrived within ``timeout_s``.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._global is not None and self._global[0] >= version, timeout=self.timeout_s):
                raise TimeoutError(f"{self.name}: no global model of version {version} within {self.timeout_s}s")
            assert self._global is not None
            return self._global[1]

    def push(self, server_round: int, state: Mapping[str, torch.Tensor], *, num_examples: int, loss: float) -> None:
        """Hands the loop's model for ``server_round`` to the runtime (returned by that round's ``fit``)."""
        out = FitOutput(OrderedDict((k, v.detach().clone()) for k, v in state.items()), min(num_examples, self._held), {"loss": loss})
        with self._cond:
            self._pushed[server_round] = out
            self._cond.notify_all()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))  # the coordinator's digits model


def training_loop(site: int, x: torch.Tensor, y: torch.Tensor, address: str, *, rounds: int, sync_every: int,
                  test: tuple[torch.Tensor, torch.Tensor], log: list[dict[str, Any]]) -> None:
    """One site's own loop; the lines marked "fedgrid" are all that fedgrid adds to it."""
    torch.manual_seed(site)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from loader

    sync = LoopSync(f"site-{site}", len(y), test)  # fedgrid
    sync.model_factory = mlp
    handle = start(sync, coordinator=address)  # fedgrid: joins in a background thread
    model.load_state_dict(sync.pull(0))  # fedgrid: start from the federation's initial model
    stream = batches()
    for step in range(1, rounds * sync_every + 1):
        inputs, targets = next(stream)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        if step % sync_every == 0:
            r = step // sync_every
            sync.push(r, model.state_dict(), num_examples=sync_every * 32, loss=loss.item())  # fedgrid
            local = OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())
            model.load_state_dict(sync.pull(r))  # fedgrid: continue from the federated average
            moved = sum(float((model.state_dict()[k] - local[k]).norm() ** 2) for k in local) ** 0.5
            log.append({"site": site, "round": r, "step": step, "loss": loss.item(), "moved": moved,
                        "state": OrderedDict((k, v.clone()) for k, v in model.state_dict().items())})
            print(f"site-{site} step {step:4d}: local loss {loss.item():.4f}; the average moved the model by {moved:.4f}", flush=True)
    handle.join(timeout=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="A plain PyTorch loop that syncs with a federation every N steps.")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sync-every", type=int, default=20, help="local steps between syncs")
    args = p.parse_args(argv)

    run_dir = Path(tempfile.mkdtemp(prefix="fedgrid-loop-"))
    config = load_config(overrides={"listen": "127.0.0.1:0", "rounds": args.rounds, "min_clients": 2, "fraction_evaluate": 1.0,
                                    "out": str(run_dir)})
    ready = threading.Event()
    server = threading.Thread(target=serve, kwargs={"config": config, "ready": ready}, daemon=True)
    server.start()
    if not ready.wait(timeout=60):
        raise TimeoutError("the coordinator did not start within 60 s")
    address = (run_dir / "address").read_text().strip()

    data = load_digits()
    log: list[dict[str, Any]] = []
    sites = []
    for site, part in enumerate(partition_iid(len(data.y_train), 2, seed=0)):
        idx = torch.from_numpy(part)
        sites.append(threading.Thread(target=training_loop, args=(site, data.x_train[idx], data.y_train[idx], address),
                                      kwargs={"rounds": args.rounds, "sync_every": args.sync_every, "log": log,
                                              "test": (data.x_test, data.y_test)}))
    t0 = time.monotonic()
    for t in sites:
        t.start()
    for t in sites:
        t.join(timeout=600)
    server.join(timeout=60)
    last = (run_dir / "metrics.jsonl").read_text().splitlines()[-1]
    print(f"done in {time.monotonic() - t0:.1f} s; last round: {last}")
    return {"run_dir": run_dir, "log": log}


if __name__ == "__main__":
    main()
