"""The Flower side of ``benchmarks/simulation.py``: one Flower 1.42 simulation (Ray backend).

Runs in the Flower virtual environment that ``simulation.py`` creates
(``benchmarks/.venv-flower``: flwr needs protobuf < 7, fedgrid's environment has 7), so it
imports no fedgrid code. Everything it needs comes from a spec JSON written by
``simulation.py`` (the only argument):

    benchmarks/.venv-flower/bin/python benchmarks/flower_sim.py SPEC.json

- data: ``x_train.npy``/``y_train.npy`` (the float32 images fedgrid's loader produces) and
  the partition (``parts_indices.npy``, ``parts_offsets.npy``: client i holds
  ``indices[offsets[i]:offsets[i+1]]``), memory-mapped by every Ray worker;
- the initial model (``torch.save`` of the tensors in ``state_dict`` order), loaded by
  position into this file's copy of the model;
- rounds, lr, momentum, batch size, local epochs, client resources (``null``: Flower's
  default, ``num_cpus=2``).

The client trains with the plain loop's code (``index_batches``: the client's whole tensors,
``randperm`` and index slicing, no ``DataLoader``; one model per Ray worker, reused), so
that Flower and ``simulation.py``'s ``loop`` differ only in the framework around the
training (Ray actors, messages, serialization, the strategy), not in how batches are made.

FedAvg (``flwr.serverapp.strategy.FedAvg``, ``fraction_train=1.0``, no federated
evaluation) over ``flwr.simulation.run_simulation`` with ``num_supernodes`` = clients.
Round times are taken on the server: the strategy calls ``evaluate_fn`` before round 1
and after every round, so round r lasts from the return of call r-1 to the entry of call
r (configure, Ray fan-out, training, aggregation). ``evaluate_fn`` only saves the final
model; the parent scores it with the same code as every other variant.

Peak memory: a thread samples every process under this one (the Ray head services and
workers) every 0.2 s and keeps each process's ``VmHWM`` (peak resident set) from
``/proc/PID/status``. Reported: this driver's own peak, the sum over Ray workers that ran
a ``ClientAppActor``, and the sum over all processes (workers, idle workers, raylet,
GCS...). Sums of per-process peaks overstate the true simultaneous peak (peaks need not
coincide, shared library pages count once per process).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

__all__ = ["mlp", "cnn", "MODELS", "index_batches", "load_positional", "shuffle_seed", "main"]

SPEC_ENV = "FEDGRID_BENCH_FLOWER_SPEC"


def mlp() -> nn.Module:
    """McMahan et al. 2017's 2NN: 784-200-200-10 (as ``fedgrid.simulation.models.fmnist_mlp``)."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(), nn.Linear(200, 10)
    )


def cnn() -> nn.Module:
    """McMahan et al. 2017's CNN (as ``fedgrid.simulation.models.fmnist_cnn``)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(3136, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


MODELS = {"mlp": mlp, "cnn": cnn}


def shuffle_seed(seed: int, server_round: int, client: int, clients: int) -> int:
    """The torch seed client ``client`` shuffles with in round ``server_round`` (1-based).

    It restates the rule of fedgrid's ``TorchClient.round_seed`` (``derive_seed(run seed,
    round, client seed, client name)``, a blake2b hash of the parts' ``repr``), so the plain
    loop and Flower draw the very batches fedgrid's clients draw: with the same initial
    model, every variant then computes the same models up to floating-point rounding, and
    the accuracy check compares like with like instead of shuffle noise (about 1.5 points
    of test accuracy at round 4 of this workload). ``simulation.py`` checks the rule
    against fedgrid's before it runs.
    """
    parts = (seed, server_round, seed, f"fashion-mnist-{client:04d}/{clients}")
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") & (
        (1 << 63) - 1
    )


def load_positional(model: nn.Module, values: list[torch.Tensor]) -> None:
    """Loads ``values`` into ``model``'s ``state_dict`` in order (names may differ between
    definitions of the same network; shapes may not).

    Raises:
        ValueError: a different number of tensors or a shape that differs.
    """
    state = model.state_dict()
    if len(state) != len(values):
        raise ValueError(f"model has {len(state)} tensors, got {len(values)}")
    for (name, ref), value in zip(state.items(), values):
        if ref.shape != value.shape:
            raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(ref.shape)}")
    model.load_state_dict(dict(zip(state, values)))


def index_batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of one client's batches by ``randperm`` and index slicing of its tensors.

    The batches ``DataLoader(TensorDataset(x, y), batch_size, shuffle=True)`` would give,
    drawn from the same random numbers at the same points (its iterator's base seed, then
    ``RandomSampler``'s seed for a generator of its own), so under ``shuffle_seed`` they are
    fedgrid's batches too; without the per-example fetch and collate of a ``DataLoader``.
    The permutation is drawn on the CPU (as ``RandomSampler`` does); on CUDA it goes over
    through pinned memory without blocking, so the loop issues no host synchronization.
    """
    torch.empty((), dtype=torch.int64).random_()  # the iterator's base seed (unused, but drawn)
    sampler_seed = int(torch.empty((), dtype=torch.int64).random_().item())
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(sampler_seed))
    if x.device.type == "cuda":
        order = order.pin_memory().to(x.device, non_blocking=True)
    elif x.device != order.device:
        order = order.to(x.device)
    for start in range(0, len(y), batch_size):
        pick = order[start : start + batch_size]
        yield x[pick], y[pick]


# ---- client side: runs inside Ray workers (this module is imported there by name) ----

_CACHE: dict[str, Any] = {}


def _client_data(partition_id: int) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, Any]]:
    """This worker's cached spec and memory-mapped data, and one client's tensors (a copy
    gathered from the memory map per call: a Ray worker serves many clients, and caching
    each one's tensors would hold the dataset once per worker)."""
    if "spec" not in _CACHE:
        spec = json.loads(Path(os.environ[SPEC_ENV]).read_text())
        work = Path(spec["work_dir"])
        _CACHE["spec"] = spec
        _CACHE["x"] = np.load(work / "x_train.npy", mmap_mode="r")
        _CACHE["y"] = np.load(work / "y_train.npy", mmap_mode="r")
        _CACHE["idx"] = np.load(work / "parts_indices.npy")
        _CACHE["off"] = np.load(work / "parts_offsets.npy")
        _CACHE["model"] = MODELS[spec["model"]]()
    spec = _CACHE["spec"]
    off = _CACHE["off"]
    idx = _CACHE["idx"][off[partition_id] : off[partition_id + 1]]
    x, y = (
        np.asarray(_CACHE["x"][idx]),
        np.asarray(_CACHE["y"][idx]),
    )  # fancy indexing copies: writable arrays
    return (torch.from_numpy(x), torch.from_numpy(y)), spec


def _train(msg: Any, context: Any) -> Any:
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    client = int(context.node_config["partition-id"])
    (x, y), spec = _client_data(client)
    model: nn.Module = _CACHE["model"]
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=spec["momentum"])
    loss_sum = torch.zeros(())  # summed as a tensor: no .item() per step
    torch.manual_seed(
        shuffle_seed(spec["seed"], int(msg.content["config"]["server-round"]), client, spec["clients"])
    )
    for _ in range(spec["local_epochs"]):
        for xb, yb in index_batches(x, y, spec["batch_size"]):
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach() * len(yb)
    n = len(y)
    seen = n * spec["local_epochs"]
    metrics = MetricRecord(
        {"train_loss": float(loss_sum) / max(seen, 1), "num-examples": n, "threads": torch.get_num_threads()}
    )
    return Message(
        content=RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg
    )


def _client_app() -> Any:
    from flwr.clientapp import ClientApp

    app = ClientApp()
    app.train()(_train)
    return app


# ---- peak memory of the process tree ----


def _own_peak_kb() -> int:
    """This process's ``VmHWM`` (``ru_maxrss`` would include the parent's size at the fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


class TreeMemory:
    """Samples the peak RSS (``VmHWM``) of every descendant of this process."""

    def __init__(self, interval_s: float = 0.2) -> None:
        import psutil

        self._psutil = psutil
        self.interval_s = interval_s
        self.peak_kb: dict[int, int] = {}
        self.titles: dict[int, set[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "TreeMemory":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.sample()
        self._stop.set()
        self._thread.join(timeout=5)

    def sample(self) -> None:
        for proc in self._psutil.Process().children(recursive=True):
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
                title = " ".join(proc.cmdline())[:80] or proc.name()
            except (OSError, self._psutil.Error):
                continue
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    self.peak_kb[proc.pid] = max(self.peak_kb.get(proc.pid, 0), int(line.split()[1]))
            self.titles.setdefault(proc.pid, set()).add(title)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def report(self) -> dict[str, Any]:
        workers = [pid for pid, titles in self.titles.items() if any("ClientAppActor" in t for t in titles)]
        mib = 1024.0
        return {
            "driver_peak_mib": _own_peak_kb() / mib,
            "workers": len(workers),
            "workers_peak_sum_mib": sum(self.peak_kb.get(pid, 0) for pid in workers) / mib,
            "all_processes": len(self.peak_kb),
            "all_processes_peak_sum_mib": sum(self.peak_kb.values()) / mib,
        }


# ---- server side ----


def main(argv: list[str]) -> None:
    spec_path = Path(argv[0]).resolve()
    spec = json.loads(spec_path.read_text())
    os.environ[SPEC_ENV] = str(spec_path)  # Ray workers inherit the environment
    torch.set_num_threads(spec["threads"])  # the server side only aggregates
    import flwr
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    rounds, clients = spec["rounds"], spec["clients"]
    model = MODELS[spec["model"]]()
    load_positional(model, torch.load(Path(spec["work_dir"]) / f"init_{spec['model']}.pt", weights_only=True))
    stamps: dict[str, dict[int, float]] = {"enter": {}, "exit": {}}
    actor_threads: list[float] = []
    final_path = Path(spec["final_path"])

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> None:
        stamps["enter"][server_round] = time.perf_counter()
        if server_round == rounds:
            torch.save(list(arrays.to_torch_state_dict().values()), final_path)
        stamps["exit"][server_round] = time.perf_counter()

    server_app = ServerApp()

    @server_app.main()
    def _server(grid: Grid, context: Context) -> None:
        strategy = FedAvg(
            fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=clients, min_available_nodes=clients
        )
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(model.state_dict()),
            num_rounds=rounds,
            train_config=ConfigRecord({"lr": spec["lr"]}),
            evaluate_fn=evaluate_fn,
        )
        last = result.train_metrics_clientapp.get(rounds)
        if last is not None:
            actor_threads.append(
                round(float(last["threads"]), 2)
            )  # mean over clients of torch threads in the actor

    backend_config = {"client_resources": spec["client_resources"]} if spec["client_resources"] else None
    memory = TreeMemory().start()
    start = time.perf_counter()
    run_simulation(
        server_app=server_app, client_app=_client_app(), num_supernodes=clients, backend_config=backend_config
    )
    total = time.perf_counter() - start
    memory.stop()
    missing = [r for r in range(rounds + 1) if r not in stamps["enter"]]
    result: dict[str, Any] = {
        "flwr": flwr.__version__,
        "torch": torch.__version__,
        "client_resources": spec["client_resources"] or "flower default",
        "round_s": [
            stamps["enter"][r] - stamps["exit"][r - 1]
            for r in range(1, rounds + 1)
            if r not in missing and r - 1 not in missing
        ],
        "startup_s": stamps["exit"].get(0, start) - start,
        "total_s": total,
        "memory": memory.report(),
        "threads": actor_threads[0] if actor_threads else None,
        "final_path": str(final_path) if final_path.exists() else None,
    }
    if missing or not final_path.exists():
        result["error"] = (
            f"rounds without a server timestamp: {missing}; final model saved: {final_path.exists()}"
        )
    Path(spec["result_path"]).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    # Run as the importable module ``flower_sim`` (not ``__main__``), so the ClientApp's
    # functions reach Ray workers by reference and their cache lives across messages.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import flower_sim

    flower_sim.main(sys.argv[1:])
