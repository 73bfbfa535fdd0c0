"""Federate an existing PyTorch training loop: every N steps, hand the model to fedgrid and
continue from the federated average.

The loop below is a plain PyTorch loop (model, optimizer, batches, ``loss.backward()``) that
keeps its optimizer and data stream across rounds. fedgrid only syncs, through an embedding
session (``fedgrid.client.connect``): each fit task carries the global model to train from,
``session.submit`` hands the loop's model back, and each evaluate task (every site
evaluates each new average, ``fraction_evaluate = 1``) carries the average to continue from.

Two sites (threads here, machines in real life) train on halves of scikit-learn's digits; a
coordinator (``fedgrid coordinator``, in a thread) runs FedAvg. Run: ``python
examples/federated_loop.py [--rounds 5] [--sync-every 20]``; prints each sync (site, step,
local loss, how far the average moved the site's model) and the last round's metrics.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid import EvaluateOutput, FitOutput, connect, load_config
from fedgrid.cli import serve
from fedgrid.simulation.datasets import load_digits, partition_iid


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def training_loop(site: int, x: torch.Tensor, y: torch.Tensor, address: str, *, sync_every: int,
                  test: tuple[torch.Tensor, torch.Tensor], log: list[dict[str, Any]]) -> None:
    """One site's own loop; the lines marked "fedgrid" are all that fedgrid adds to it."""
    torch.manual_seed(site)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))  # the coordinator's digits model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = itertools.chain.from_iterable(itertools.repeat(DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)))
    step, loss = 0, float("nan")
    with connect(address, name=f"site-{site}", num_examples=len(y)) as session:  # fedgrid: joins; leaves on exit
        for task in session.tasks():  # fedgrid: until the run is over
            local = snapshot(model)
            model.load_state_dict(task.state)  # fedgrid: the global model (fit: to train from; evaluate: the new average)
            if task.kind == "evaluate":
                moved = sum(float((task.state[k] - local[k]).norm() ** 2) for k in local) ** 0.5
                logits = model(test[0]).detach()
                test_loss, accuracy = float(nn.functional.cross_entropy(logits, test[1])), float((logits.argmax(1) == test[1]).float().mean())
                session.submit(EvaluateOutput(len(test[1]), {"loss": test_loss, "accuracy": accuracy}))  # fedgrid
                log.append({"site": site, "round": task.round, "step": step, "loss": loss, "moved": moved, "state": snapshot(model)})
                print(f"site-{site} step {step:4d}: local loss {loss:.4f}; the average moved the model by {moved:.4f}", flush=True)
                continue
            with session.compute():  # fedgrid: this is compute in the goodput each result reports
                for _ in range(sync_every):  # the host's own training steps
                    inputs, targets = next(batches)
                    optimizer.zero_grad()
                    loss_t = nn.functional.cross_entropy(model(inputs), targets)
                    loss_t.backward()
                    optimizer.step()
                    step, loss = step + 1, loss_t.item()
            session.submit(FitOutput(snapshot(model), min(sync_every * 32, len(y)), {"loss": loss}))  # fedgrid


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="A plain PyTorch loop that syncs with a federation every N steps.", allow_abbrev=False)
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

    data, log = load_digits(), []  # type: ignore[var-annotated]
    sites = [threading.Thread(target=training_loop, args=(i, data.x_train[idx], data.y_train[idx], address),
                              kwargs={"sync_every": args.sync_every, "test": (data.x_test, data.y_test), "log": log})
             for i, idx in enumerate(torch.from_numpy(part) for part in partition_iid(len(data.y_train), 2, seed=0))]
    for t in sites:
        t.start()
    for t in sites:
        t.join(timeout=600)
    server.join(timeout=60)
    print(f"last round: {(run_dir / 'metrics.jsonl').read_text().splitlines()[-1]}")
    return {"run_dir": run_dir, "log": log}


if __name__ == "__main__":
    main()
