"""Federated simulation speed: fedgrid's batched and sequential engines, a plain PyTorch
loop and Flower 1.42 (Ray backend), side by side on the same work (issues 6 and 16).

The work: ``--clients`` clients (default 100) of Fashion-MNIST split by Dirichlet(``--alpha``,
0.5) label skew (``partition_dirichlet``, one seed), every client training every round,
``--local-epochs`` 1, batch 32, plain SGD (lr 0.05, momentum 0), FedAvg weighted by
examples, for McMahan et al. 2017's 2-layer MLP (784-200-200-10) and CNN. The initial
model of each network is built once from ``--seed`` and handed to every variant. Variants
(``--variants``):

    batched          fedgrid run_simulation, engine="batched" (batch_clients 0: auto)
    sequential       fedgrid run_simulation, engine="sequential"
    auto             fedgrid run_simulation, engine="auto" (the default engine)
    loop             plain PyTorch, the fastest loop a user would write: every client's
                     whole tensors on the device, built once; per client, load the global
                     weights into one model, SGD over batches by randperm + index slicing
                     (no DataLoader), add the weights times examples; average
    loop-dataloader  the same loop over DataLoader(shuffle=True, batch_size=32) (issue 6's
                     baseline; not in the default set)
    loop-channels-last  ``loop`` with the model and 4-d inputs in channels-last layout, as
                     fedgrid's TorchClient trains a CNN on the CPU: how much of fedgrid's CNN
                     speed is that layout (not in the default set)
    flower           Flower 1.42 run_simulation, client_resources num_cpus=1 (flower_sim.py);
                     its clients train with the loop's code (index slicing, no DataLoader)
    flower-default   the same with Flower's default client resources (num_cpus=2)

Each run of a variant is a process of its own (so its peak memory is its own). The
variants of a model run ``--repeats`` times (3), interleaved (v1, v2, v3, v1, v2, v3, ...),
so that a slow stretch of a noisy machine falls on every variant rather than on one. Round 1
of a run is a warm-up; a run's seconds per round is the median of the rest (``--rounds`` 4:
median of 3), a variant's the median over its runs. Each ratio is taken per repeat
(repeat r's baseline over repeat r's variant, which ran next to each other); the headline
is the median of those, with their min-max. No variant evaluates inside its timed rounds;
this script scores every final model on the 10k test images with one function.

    .venv/bin/python benchmarks/simulation.py                                  # the full run
    .venv/bin/python benchmarks/simulation.py --clients 10 --rounds 2 --repeats 1 --out /tmp/sim.json
    .venv/bin/python benchmarks/simulation.py --models mlp --variants batched,loop

Flower is installed on first use into ``benchmarks/.venv-flower`` (``python -m venv``, then
``pip install "flwr[simulation]==1.42.*" torch==2.13.0 numpy psutil``; torch is pinned
because any other version downloads a multi-GB CUDA build here). Results go to
``benchmarks/results/simulation.json``. ``simulation_gpu.py`` reuses this file's workers
for the 1,000-client measurement on one GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from flower_sim import MODELS, index_batches, load_positional, shuffle_seed  # noqa: E402  (the benchmark's own model definitions)

__all__ = [
    "accuracy",
    "add_work_arguments",
    "check_work_arguments",
    "combine",
    "main",
    "prepare",
    "run_variant",
    "summarize",
    "train_flops_per_example",
    "write_results",
]

FEDGRID = {"batched": "batched", "sequential": "sequential", "auto": "auto"}
LOOPS = {"loop": "slice", "loop-dataloader": "dataloader", "loop-channels-last": "slice-nhwc"}
FLOWER = {"flower": {"num_cpus": 1, "num_gpus": 0.0}, "flower-default": None}
ALL_VARIANTS = (*FEDGRID, *LOOPS, *FLOWER)
DEFAULT_VARIANTS = "batched,sequential,auto,loop,flower,flower-default"
FLOWER_PINS = ("flwr[simulation]==1.42.*", "torch==2.13.0", "numpy", "psutil")
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"


# ---------------------------------------------------------------- workers (one per variant)


def _peak_rss_mib() -> float:
    """This process's peak resident set (``VmHWM``). Not ``ru_maxrss``: Linux carries that
    across exec, so a worker would report at least its parent's size at the fork."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _positional(
    template: "OrderedDict[str, torch.Tensor]", values: list[torch.Tensor]
) -> "OrderedDict[str, torch.Tensor]":
    if [tuple(t.shape) for t in template.values()] != [tuple(v.shape) for v in values]:
        raise ValueError("the shared initial model does not fit fedgrid's model (shapes differ)")
    return OrderedDict((k, v.clone()) for k, v in zip(template, values))


def _progress(spec: dict[str, Any], round_s: list[float]) -> None:
    """Writes the rounds done so far, for ``run_variant`` to report if the run times out."""
    Path(spec["result_path"] + ".partial").write_text(json.dumps(round_s))


def work_fedgrid(spec: dict[str, Any]) -> dict[str, Any]:
    """One fedgrid run: ``run_simulation`` with the config keys of issue 6."""
    import fedgrid.simulation.run as sim_run
    from fedgrid.config import config_keys, load_config

    keys = config_keys()
    dataset_key = "dataset" if "dataset" in keys else "task"
    overrides: dict[str, Any] = {
        dataset_key: "fashion-mnist",
        "data_dir": spec["data_dir"],
        "model": spec["model"],
        "engine": spec["engine"],
        "clients": spec["clients"],
        "fraction_fit": 1.0,
        "local_epochs": spec["local_epochs"],
        "batch_size": spec["batch_size"],
        "lr": spec["lr"],
        "momentum": spec["momentum"],
        "optimizer": "sgd",
        "partition": f"dirichlet:{spec['alpha']}",
        "rounds": spec["rounds"],
        "seed": spec["seed"],
        "batch_clients": spec["batch_clients"],
        "device": spec["device"],
    }
    optional = {
        "optimizer",
        "batch_clients",
        "device",
    }  # absent: fedgrid's own choice (sgd, auto, CUDA when present)
    missing = sorted(k for k in overrides if k not in keys and k not in optional)
    if missing:
        raise RuntimeError(f"fedgrid.config has no key(s) {', '.join(missing)} yet")
    notes: list[str] = []

    class EngineNotes(logging.Handler):  # what fedgrid says about its engine choice goes in the notes
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if ("engine" in message or "batched" in message) and message not in notes and len(notes) < 8:
                notes.append(message)

    engine_k = _record_chunk_sizes()
    fedgrid_log = logging.getLogger("fedgrid")
    fedgrid_log.setLevel(logging.INFO)
    fedgrid_log.addHandler(EngineNotes())
    init = torch.load(Path(spec["work_dir"]) / f"init_{spec['model']}.pt", weights_only=True)
    # Hand fedgrid the shared initial model and no per-round evaluation (it would count in
    # wall_s); run_simulation builds both through ``resolve``.
    original = getattr(sim_run, "resolve", None)
    if original is not None:

        def resolve(*args: Any, **kwargs: Any) -> Any:
            resolved = original(*args, **kwargs)
            same = all(torch.equal(a, b) for a, b in zip(resolved.initial_state.values(), init))
            notes.append(f"fedgrid's own seeded init identical to the shared one: {same}")
            return dataclasses.replace(
                resolved, initial_state=_positional(resolved.initial_state, init), evaluate=None
            )

        sim_run.resolve = resolve  # type: ignore[attr-defined]
    else:
        notes.append(
            "run_simulation has no resolve hook: fedgrid built its own init from the same seed, evaluated each round"
        )
    config = load_config(overrides={k: v for k, v in overrides.items() if k in keys})
    stamps: list[float] = []
    walls: list[float] = []

    def on_round(m: Any) -> None:
        stamps.append(time.perf_counter())
        walls.append(m.wall_s)
        _progress(spec, walls[:1] + [b - a for a, b in zip(stamps, stamps[1:])])

    final, history = sim_run.run_simulation(config, on_round=on_round)
    if final is None:
        raise RuntimeError("run_simulation returned no model")
    failed = sum(m.clients_failed for m in history)
    if failed:
        notes.append(f"{failed} client updates failed")
    round_s = walls[:1] + [b - a for a, b in zip(stamps, stamps[1:])]  # round 1: the engine's own wall_s
    notes.append(f"engine {spec['engine']} via fedgrid.simulation.run.run_simulation")
    if engine_k.get("k_values"):
        first = engine_k["budgets"][0] if engine_k["budgets"] else {}
        free = (
            f", {first['free_bytes'] / 2**30:.1f} GiB free of {first['total_bytes'] / 2**30:.1f}"
            if "free_bytes" in first
            else ""
        )
        budget = f" (budget {first['budget_bytes'] / 2**30:.2f} GiB{free} at the first call)" if first else ""
        notes.append(f"K (BatchedTrainer.chunk_size): {'/'.join(map(str, engine_k['k_values']))}{budget}")
    return {
        "round_s": round_s,
        "engine_wall_s": walls,
        "final": list(final.values()),
        "notes": notes,
        "extra": [dict(m.extra) for m in history],
        "engine_k": engine_k,
    }


def _record_chunk_sizes() -> dict[str, Any]:
    """Records what the batched engine chose, by wrapping (in this worker process only)
    ``BatchedTrainer.chunk_size`` (the K it returns) and ``memory_budget`` (the budget it
    gave, with the free and total CUDA memory it read). An engine without them records
    nothing; the log lines in the notes still say what it chose."""
    record: dict[str, Any] = {"k_values": [], "chunk_size_calls": 0, "budgets": [], "budget_calls": 0}
    try:
        import fedgrid.simulation.batched as batched
    except ImportError:
        return record
    trainer = getattr(batched, "BatchedTrainer", None)
    chunk_size = getattr(trainer, "chunk_size", None)
    budget_fn = getattr(batched, "memory_budget", None)
    if budget_fn is not None:

        def memory_budget(device: torch.device, *args: Any, **kwargs: Any) -> int:
            budget = budget_fn(device, *args, **kwargs)
            entry: dict[str, Any] = {"device": str(device), "budget_bytes": int(budget)}
            if torch.device(device).type == "cuda":
                free, total = torch.cuda.mem_get_info(device)
                entry.update(free_bytes=int(free), total_bytes=int(total))
            record["budget_calls"] += 1
            if len(record["budgets"]) < 2:  # the first (before the data moved to the device) and the second
                record["budgets"].append(entry)
            record["last_budget"] = entry
            return budget

        batched.memory_budget = memory_budget  # type: ignore[assignment]
    if trainer is not None and chunk_size is not None:

        def wrapped(self: Any, *args: Any, **kwargs: Any) -> int:
            k = chunk_size(self, *args, **kwargs)
            record["chunk_size_calls"] += 1
            if k not in record["k_values"]:
                record["k_values"].append(int(k))
            return k

        trainer.chunk_size = wrapped
    return record


def work_loop(spec: dict[str, Any]) -> dict[str, Any]:
    """The plain PyTorch loop: no fedgrid code in it.

    ``spec["loop"]`` is ``"slice"`` (``loop``: every client's tensors moved to the device
    once, batches by ``index_batches``) or ``"dataloader"`` (``loop-dataloader``: a
    ``DataLoader(shuffle=True)`` per client, batches moved per step). Both draw the same
    batches under the same per-client, per-round seed. ``spec["loop_clients"]`` (optional)
    trains only those clients of the partition, averaged among themselves: a subset that
    ``simulation_gpu.py`` times and scales.
    """
    device = torch.device(spec["device"])
    work = Path(spec["work_dir"])
    x = torch.from_numpy(np.load(work / "x_train.npy"))
    y = torch.from_numpy(np.load(work / "y_train.npy"))
    indices, offsets = np.load(work / "parts_indices.npy"), np.load(work / "parts_offsets.npy")
    chosen = spec.get("loop_clients") or list(range(len(offsets) - 1))
    parts = [torch.from_numpy(indices[offsets[i] : offsets[i + 1]]) for i in chosen]
    model = MODELS[spec["model"]]().to(device)
    load_positional(model, torch.load(work / f"init_{spec['model']}.pt", weights_only=True))
    slicing = spec["loop"] in ("slice", "slice-nhwc")
    nhwc = spec["loop"] == "slice-nhwc"
    if nhwc:
        model = model.to(memory_format=torch.channels_last)
    bs = spec["batch_size"]
    if slicing:
        clients: list[Any] = [(x[p].to(device), y[p].to(device)) for p in parts]
    else:
        clients = [DataLoader(TensorDataset(x[p], y[p]), batch_size=bs, shuffle=True) for p in parts]
    sizes = [len(p) for p in parts]
    examples = sum(sizes)

    def batches(client: Any) -> Any:
        if slicing:
            for xb, yb in index_batches(client[0], client[1], bs):
                yield (xb.contiguous(memory_format=torch.channels_last) if nhwc and xb.dim() == 4 else xb), yb
            return
        for xb, yb in client:
            yield xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)

    global_state = [t.detach().clone() for t in model.state_dict().values()]
    names = list(model.state_dict())
    round_s = []
    for server_round in range(1, spec["rounds"] + 1):
        start = time.perf_counter()
        total = [torch.zeros_like(t) for t in global_state]
        for index, client, n in zip(chosen, clients, sizes):
            model.load_state_dict(dict(zip(names, global_state)))
            optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=spec["momentum"])
            torch.manual_seed(shuffle_seed(spec["seed"], server_round, index, spec["clients"]))
            for _ in range(spec["local_epochs"]):
                for xb, yb in batches(client):
                    optimizer.zero_grad(set_to_none=True)
                    nn.functional.cross_entropy(model(xb), yb).backward()
                    optimizer.step()
            with torch.no_grad():
                for acc, t in zip(total, model.state_dict().values()):
                    acc.add_(t, alpha=n)
        global_state = [t / examples for t in total]
        if device.type == "cuda":
            torch.cuda.synchronize()
        round_s.append(time.perf_counter() - start)
        _progress(spec, round_s)
    notes = [
        f"batches: {'randperm + index slicing' if slicing else 'DataLoader'}{', channels-last' if nhwc else ''}"
    ]
    if spec.get("loop_clients"):
        notes.append(f"trained {len(chosen)} of the {spec['clients']} clients ({examples} examples)")
    return {
        "round_s": round_s,
        "final": [t.cpu() for t in global_state],
        "notes": notes,
        "loop_clients": len(chosen),
        "loop_examples": examples,
    }


def worker_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    out: dict[str, Any] = {}
    try:
        result = work_fedgrid(spec) if spec["kind"] == "fedgrid" else work_loop(spec)
        torch.save(
            [t.detach().cpu() for t in result.pop("final")], spec["final_path"]
        )  # the parent loads it without CUDA
        out = {**result, "final_path": spec["final_path"]}
    except Exception as exc:  # reported as a FAILED row
        import traceback

        traceback.print_exc()
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out["peak_rss_mib"] = _peak_rss_mib()
    out["threads"] = torch.get_num_threads()
    if torch.cuda.is_available() and spec["device"] == "cuda":
        out["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
        out["gpu"] = torch.cuda.get_device_name()  # here, not in the parent: it holds no CUDA context
    Path(spec["result_path"]).write_text(json.dumps(out))


# ---------------------------------------------------------------- the parent


def ensure_flower(venv: Path, log: Callable[[str], None]) -> Path:
    """The Flower interpreter, creating ``venv`` and installing ``FLOWER_PINS`` if needed."""
    python = venv / "bin" / "python"
    probe = [
        str(python),
        "-c",
        "import flwr, ray, torch, psutil; print(flwr.__version__, ray.__version__, torch.__version__)",
    ]
    if python.exists():
        found = subprocess.run(probe, capture_output=True, text=True)
        if found.returncode == 0 and found.stdout.startswith("1.42"):
            return python
    log(f"installing Flower into {venv} (pip install {' '.join(FLOWER_PINS)})")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *FLOWER_PINS], check=True)
    found = subprocess.run(probe, capture_output=True, text=True, check=True)
    log(f"Flower environment: flwr, ray, torch = {found.stdout.strip()}")
    return python


def matmul_gflops(threads: int, device: str, n: int, repeats: int = 7) -> float:
    """float32 ``torch.mm`` of two n x n matrices: median GFLOP/s (the compute limit)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    times = []
    for i in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    del a, b
    if device == "cuda":
        torch.cuda.empty_cache()  # the workers' engines size K from free memory
    return 2 * n**3 / statistics.median(times) / 1e9


def train_flops_per_example(name: str, batch: int) -> float:
    """Forward + backward FLOPs of one example (``FlopCounterMode``, one batch of ``batch``)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = MODELS[name]()
    x, y = torch.rand(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    with FlopCounterMode(display=False) as counter:
        nn.functional.cross_entropy(model(x), y).backward()
    return counter.get_total_flops() / batch


@torch.no_grad()
def accuracy(name: str, final_path: str, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy of the final model a run saved (tensors only: ``weights_only``, no code runs)."""
    model = MODELS[name]()
    load_positional(model, torch.load(final_path, map_location="cpu", weights_only=True))
    model.eval()
    correct = sum(
        int((model(x[i : i + 2000]).argmax(1) == y[i : i + 2000]).sum()) for i in range(0, len(y), 2000)
    )
    return correct / len(y)


def check_batch_order(args: argparse.Namespace) -> str:
    """Whether ``shuffle_seed`` (the loop's and Flower's) is the seed fedgrid's clients shuffle with."""
    try:
        from fedgrid.simulation.tasks import ClientOptions, builtin_client
        from fedgrid.types import FitIns

        last = args.clients - 1
        client = builtin_client(
            last,
            args.clients,
            args.seed,
            options=ClientOptions(
                dataset="fashion-mnist",
                data_dir=str(args.data_dir),
                partitioner=f"dirichlet:{args.alpha}",
                device="cpu",
            ),
        )
        same = all(
            client.round_seed(FitIns(round=r, config={"seed": args.seed}))
            == shuffle_seed(args.seed, r, last, args.clients)
            for r in range(1, args.rounds + 1)
        )
    except Exception as exc:  # an informative check, not a precondition
        return f"could not compare with fedgrid's clients ({type(exc).__name__}: {exc})"
    if same:
        return "loop and Flower clients shuffle with fedgrid's per-client, per-round seeds (same batches in every variant)"
    return "fedgrid's clients seed their shuffling differently now: accuracies differ by shuffle noise too"


def prepare(args: argparse.Namespace, work: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Writes the shared data, partition and initial models; checks the model definitions."""
    from fedgrid.simulation.datasets import load_fashion_mnist, partition_dirichlet

    data = load_fashion_mnist(args.data_dir)
    np.save(work / "x_train.npy", data.x_train.numpy())
    np.save(work / "y_train.npy", data.y_train.numpy())
    parts = partition_dirichlet(data.y_train.numpy(), args.clients, args.alpha, args.seed)
    np.save(work / "parts_indices.npy", np.concatenate(parts))
    np.save(work / "parts_offsets.npy", np.cumsum([0] + [len(p) for p in parts]))
    sizes = [len(p) for p in parts]
    log(
        f"data: {len(data.y_train)} train / {len(data.y_test)} test images; {args.clients} clients, "
        f"Dirichlet({args.alpha}): {min(sizes)}..{max(sizes)} examples (median {int(np.median(sizes))})"
    )
    try:
        from fedgrid.simulation import models as fedgrid_models

        factories = {"mlp": fedgrid_models.fmnist_mlp, "cnn": fedgrid_models.fmnist_cnn}
    except (ImportError, AttributeError):
        factories = {}
        log("fedgrid.simulation.models has no fmnist_mlp/fmnist_cnn: using the benchmark's definitions")
    checked = []
    for name in args.models:
        torch.manual_seed(args.seed)
        ours = list(MODELS[name]().state_dict().values())
        if name in factories:
            torch.manual_seed(args.seed)
            theirs = list(factories[name]().state_dict().values())
            same = len(ours) == len(theirs) and all(
                a.shape == b.shape and torch.equal(a, b) for a, b in zip(ours, theirs)
            )
            if not same:
                raise SystemExit(
                    f"{name}: the benchmark's model differs from fedgrid.simulation.models (shapes or seeded init)"
                )
            checked.append(name)
        torch.save(ours, work / f"init_{name}.pt")
    if checked:
        log(
            f"models: the benchmark's {', '.join(checked)} equal fedgrid.simulation.models' (shapes and seeded init)"
        )
    log(f"batch order: {check_batch_order(args)}")
    log(f"one initial model per network from seed {args.seed}, shared by every variant")
    return {"x_test": data.x_test, "y_test": data.y_test, "examples": sum(sizes), "sizes": sizes}


def run_variant(
    args: argparse.Namespace,
    work: Path,
    model: str,
    variant: str,
    flower_python: Path | None,
    *,
    repeat: int = 0,
    extra: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """One run of ``variant`` on ``model`` in a process of its own; its result, or ``{"error": ...}``.

    Args:
        args: this script's options (``simulation_gpu.py`` passes a namespace with the same names).
        work: the folder ``prepare`` wrote the shared data and initial models to.
        model: ``"mlp"`` or ``"cnn"``.
        variant: one of ``ALL_VARIANTS``.
        flower_python: the Flower interpreter (``None``: Flower variants fail with a note).
        repeat: which repeat this is (names the run's files).
        extra: further spec entries for the worker (``loop_clients``).
        timeout: seconds the run may take (default ``args.timeout``); past it the whole
            process tree is killed and the run is an error.
    """
    tag = f"{model}_{variant}_r{repeat}"
    timeout = args.timeout if timeout is None else timeout
    spec = {
        "model": model,
        "work_dir": str(work),
        "data_dir": str(args.data_dir),
        "clients": args.clients,
        "rounds": args.rounds,
        "local_epochs": args.local_epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "momentum": args.momentum,
        "alpha": args.alpha,
        "seed": args.seed,
        "threads": args.threads,
        "device": args.device,
        "batch_clients": args.batch_clients,
        "final_path": str(work / f"final_{tag}.pt"),
        "result_path": str(work / f"result_{tag}.json"),
    }
    env = dict(os.environ)
    if args.malloc_tunables:
        env["GLIBC_TUNABLES"] = MALLOC_TUNABLES
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # fedgrid picks CUDA when it sees one
    if variant in FLOWER:
        if flower_python is None:
            return {"error": "Flower environment unavailable"}
        spec["client_resources"] = FLOWER[variant]
        command = [str(flower_python), str(HERE / "flower_sim.py")]
    else:
        spec.update(
            {"kind": "fedgrid", "engine": FEDGRID[variant]}
            if variant in FEDGRID
            else {"kind": "loop", "loop": LOOPS[variant]}
        )
        command = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    spec.update(extra or {})
    spec_path = work / f"spec_{tag}.json"
    spec_path.write_text(json.dumps(spec))
    log_path = work / f"log_{tag}.txt"
    start = time.perf_counter()
    with open(log_path, "w") as log_file:
        # A session of its own, so a timeout ends the whole tree (Ray's raylet and workers too).
        proc = subprocess.Popen(
            [*command, str(spec_path)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            partial = Path(spec["result_path"] + ".partial")
            done = json.loads(partial.read_text()) if partial.exists() else []
            rounds = f"; rounds done, s: {' '.join(f'{t:.2f}' for t in done)}" if done else "; no round done"
            return {
                "error": f"timed out after {timeout:.0f} s{rounds} (log: {log_path})",
                "partial_round_s": done,
            }
    result_path = Path(spec["result_path"])
    if not result_path.exists():
        tail = log_path.read_text()[-600:].strip().replace("\n", " | ")
        return {"error": f"exit {proc.returncode}, no result; log tail: {tail}"}
    result = json.loads(result_path.read_text())
    result["process_s"] = time.perf_counter() - start
    result["log"] = str(log_path)
    if variant in FLOWER and "memory" in result:
        memory = result["memory"]
        result["peak_rss_mib"] = memory["driver_peak_mib"] + memory["workers_peak_sum_mib"]
    return result


def summarize(row: dict[str, Any], args: argparse.Namespace, flops_round: float, examples: int) -> None:
    """Adds one run's seconds per round (the median of its timed rounds), clients per second and FLOP/s."""
    timed = row.get("round_s", [])[args.warmup :]
    if "error" in row or not timed:
        row.setdefault("error", "no timed rounds")
        return
    s = statistics.median(timed)
    row.update(
        {
            "s_per_round": s,
            "clients_per_s": args.clients / s,
            "gflops": flops_round / s / 1e9,
            "examples_per_round": examples,
        }
    )


def combine(runs: list[dict[str, Any]], args: argparse.Namespace, flops_round: float) -> dict[str, Any]:
    """A variant's row from its runs (one per repeat, in order, failed ones included).

    Seconds per round: the median over the runs that succeeded of each run's median round;
    ``spread_s`` their min and max. Peak memory: the largest of the runs'. Accuracy: the
    median of the runs' (they train the same models, so they agree to float rounding).
    """
    good = [r for r in runs if "error" not in r]
    row: dict[str, Any] = {"runs": runs, "failed_runs": len(runs) - len(good)}
    if not good:
        row["error"] = runs[0]["error"] if runs else "not run"
        return row
    per_run = [r["s_per_round"] for r in good]
    s = statistics.median(per_run)
    accs = [r["accuracy"] for r in good if r.get("accuracy") is not None]
    row.update(
        {
            "s_per_round": s,
            "runs_s_per_round": per_run,
            "spread_s": [min(per_run), max(per_run)],
            "clients_per_s": args.clients / s,
            "gflops": flops_round / s / 1e9,
            "peak_rss_mib": max(r.get("peak_rss_mib") or 0.0 for r in good),
            "accuracy": statistics.median(accs) if accs else None,
            "accuracies": accs,
            "threads": good[0].get("threads"),
            "notes": good[0].get("notes", []),
        }
    )
    gpu = [r["peak_gpu_mib"] for r in good if r.get("peak_gpu_mib") is not None]
    if gpu:
        row["peak_gpu_mib"] = max(gpu)
    return row


def goals(model: str, device: str) -> dict[tuple[str, str], float]:
    """Issue 16's goals, against the plain loop: item 3's table on CPU, item 4's on CUDA."""
    if device == "cuda":
        return {("batched", "loop"): 10.0}
    if model == "mlp":
        return {("batched", "loop"): 2.5, ("sequential", "loop"): 0.9}
    return {("auto", "loop"): 1.0}


RATIO_PAIRS = (
    ("batched", "loop"),
    ("sequential", "loop"),
    ("auto", "loop"),
    ("batched", "flower-best"),
    ("sequential", "flower-best"),
    ("auto", "flower-best"),
    ("loop", "flower-best"),
    ("loop", "loop-dataloader"),
)


def ratios(rows: dict[str, dict[str, Any]], model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Speed ratios, baseline seconds per round over the variant's, against ``goals``.

    Per repeat r: repeat r's baseline run over repeat r's variant run (they ran next to
    each other, under the same load); ``value`` is the median of those, ``min``/``max``
    their range, ``of_medians`` the ratio of the two medians. ``flower-best`` is the
    Flower variant with the lower median. A ratio whose two sides did not both run is left
    out, unless it has a goal (then its value is ``None``).
    """

    def s(v: str) -> float | None:
        return rows.get(v, {}).get("s_per_round")

    flowers = [v for v in FLOWER if s(v)]
    best_flower = min(flowers, key=lambda v: s(v)) if flowers else None  # type: ignore[arg-type, return-value]
    wanted = goals(model, args.device)
    out = []
    for num, den in RATIO_PAIRS:
        base = best_flower if den == "flower-best" else den
        goal = wanted.get((num, den))
        if (num not in rows or base is None or base not in rows) and goal is None:
            continue
        per_repeat: list[float | None] = []
        if base is not None and num in rows and base in rows:
            for b, v in zip(rows[base]["runs"], rows[num]["runs"]):
                ok = b.get("s_per_round") and v.get("s_per_round")
                per_repeat.append(b["s_per_round"] / v["s_per_round"] if ok else None)
        values = [r for r in per_repeat if r is not None]
        value = statistics.median(values) if values else None
        out.append(
            {
                "ratio": f"{num}/{den}",
                "baseline": base,
                "value": value,
                "per_repeat": per_repeat,
                "min": min(values) if values else None,
                "max": max(values) if values else None,
                "of_medians": s(base) / s(num) if base and s(base) and s(num) else None,  # type: ignore[operator]
                "goal": goal,
                "met": None if goal is None or value is None else value >= goal,
            }
        )
    return out


def log_table(model: str, rows: dict[str, dict[str, Any]], limit: float, log: Callable[[str], None]) -> None:
    log(
        f"\n{model}: {'variant':<16}{'s/round':>9}  {'runs (s/round)':<24}{'min-max':<13}{'clients/s':>10}{'peak MiB':>10}"
        f"{'accuracy':>10}{'GFLOP/s':>9}{'% mm':>6}{'thr':>5}"
    )
    for variant, row in rows.items():
        if "error" in row:
            log(f"{'':<5}{variant:<16} FAILED: {row['error'][:300]}")
            continue
        runs = " ".join(f"{r['s_per_round']:.3f}" if "error" not in r else "FAIL" for r in row["runs"])
        spread = f"{row['spread_s'][0]:.3f}-{row['spread_s'][1]:.3f}"
        acc = f"{row['accuracy']:.4f}" if row.get("accuracy") is not None else "-"
        log(
            f"{'':<5}{variant:<16}{row['s_per_round']:>9.3f}  {runs:<24}{spread:<13}{row['clients_per_s']:>10.1f}"
            f"{row['peak_rss_mib']:>10.0f}{acc:>10}{row['gflops']:>9.1f}{100 * row['gflops'] / limit:>6.0f}{row.get('threads') or 0:>5.0f}"
        )


def log_ratios(res: dict[str, Any], log: Callable[[str], None]) -> None:
    for r in res["ratios"]:
        value = f"{r['value']:.2f}x" if r["value"] is not None else "n/a"
        goal = (
            f"goal >= {r['goal']:.2f}x: {'met' if r['met'] else 'NOT met' if r['met'] is not None else 'n/a'}"
            if r["goal"]
            else ""
        )
        base = f" ({r['baseline']})" if r["baseline"] and r["ratio"].endswith("flower-best") else ""
        detail = ""
        if r["value"] is not None:
            each = " ".join(f"{x:.2f}" if x is not None else "-" for x in r["per_repeat"])
            detail = (
                f"per repeat {each}; min-max {r['min']:.2f}-{r['max']:.2f}; of medians {r['of_medians']:.2f}"
            )
        log(f"     {r['ratio']:<28}{value:>7}{base:<17} {goal:<26} {detail}")


def add_work_arguments(parser: argparse.ArgumentParser, *, clients: int, rounds: int, repeats: int) -> None:
    """The options that define the work and its timing, shared with ``simulation_gpu.py``."""
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--clients", type=int, default=clients)
    parser.add_argument(
        "--rounds", type=int, default=rounds, help="rounds per run, the first --warmup of them untimed"
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--repeats", type=int, default=repeats, help="runs of every variant, interleaved; medians over them"
    )
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--batch-clients", type=int, default=0, help="fedgrid's batch_clients (0: K from memory)"
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads of every in-process run"
    )
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="keep the shared files, logs and final models here"
    )


def check_work_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Splits ``--models`` and rejects what cannot run (argparse's error: the message and exit 2)."""
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s): {', '.join(unknown)} (from {', '.join(MODELS)})")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.rounds <= args.warmup:
        parser.error(f"--rounds must exceed --warmup ({args.warmup})")
    if args.device == "cuda" and not torch.cuda.is_available():  # counts devices; creates no CUDA context
        parser.error("--device cuda: torch sees no CUDA device here")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_work_arguments(parser, clients=100, rounds=4, repeats=3)
    parser.add_argument(
        "--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, from {', '.join(ALL_VARIANTS)}"
    )
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda")
    )
    parser.add_argument(
        "--data-dir", type=Path, default=HERE.parents[1] / "shared" / "data" / "fashion-mnist"
    )
    parser.add_argument("--out", type=Path, default=HERE / "results" / "simulation.json")
    parser.add_argument("--flower-venv", type=Path, default=HERE / ".venv-flower")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one variant may take")
    parser.add_argument(
        "--max-spread", type=float, default=2.0, help="accuracy points beyond which the comparison is VOID"
    )
    parser.add_argument(
        "--malloc-tunables", action="store_true", help=f"GLIBC_TUNABLES={MALLOC_TUNABLES} for every variant"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    check_work_arguments(parser, args)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in ALL_VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s): {', '.join(unknown)}")
    if args.clients > 100 and args.device == "cpu":
        print(f"note: {args.clients} clients on CPU; the issue's 1,000-client goal is for a GPU")

    started, load_before = time.monotonic(), os.getloadavg()
    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    work_ctx = tempfile.TemporaryDirectory(prefix="fedgrid-sim-") if args.work_dir is None else None
    work = Path(work_ctx.name) if work_ctx else args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    log(
        f"simulation benchmark: {args.clients} clients, {args.rounds} rounds ({args.warmup} warm-up), "
        f"{args.local_epochs} local epoch(s), batch {args.batch_size}, SGD lr {args.lr} momentum {args.momentum}, "
        f"device {args.device}, {args.threads} torch threads, {os.cpu_count()} CPUs, load average {load_before[0]:.1f}"
    )
    shared = prepare(args, work, log)
    n = 8192 if args.device == "cuda" else 2048  # a GPU needs a larger product to reach its rate
    limit = matmul_gflops(args.threads, args.device, n)
    log(f"float32 matmul ({n}x{n}, {args.threads} threads, median of 7): {limit:.1f} GFLOP/s")
    flower_python = None
    if any(v in FLOWER for v in variants):
        try:
            flower_python = ensure_flower(args.flower_venv, log)
        except (subprocess.CalledProcessError, OSError) as exc:
            log(f"Flower environment FAILED: {exc}")

    results: dict[str, Any] = {}
    for model in args.models:
        per_example = train_flops_per_example(model, args.batch_size)
        flops_round = per_example * shared["examples"] * args.local_epochs
        log(
            f"\n{model}: {per_example / 1e6:.2f} MFLOP per training example (forward + backward, FlopCounterMode), "
            f"{flops_round / 1e9:.1f} GFLOP per round"
        )
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for repeat in range(args.repeats):  # interleaved: v1, v2, v3, v1, v2, v3, ...
            for variant in variants:
                log(f"  running {model} / {variant} (repeat {repeat + 1}/{args.repeats}) ...")
                row = run_variant(args, work, model, variant, flower_python, repeat=repeat)
                summarize(row, args, flops_round, shared["examples"])
                if row.get("final_path"):
                    row["accuracy"] = accuracy(model, row["final_path"], shared["x_test"], shared["y_test"])
                runs[variant].append(row)
                shown = (
                    f"{row['s_per_round']:.3f} s/round, accuracy {row.get('accuracy', float('nan')):.4f}"
                    if "error" not in row
                    else f"FAILED: {row['error'][:300]}"
                )
                log(f"    {shown}")
                for note in row.get("notes", []) if repeat == 0 else []:
                    log(f"      {note}")
        rows = {v: combine(runs[v], args, flops_round) for v in variants}
        accs = [a for r in rows.values() for a in r.get("accuracies", [])]
        spread = 100 * (max(accs) - min(accs)) if accs else None
        results[model] = {
            "flops_per_example": per_example,
            "flops_per_round": flops_round,
            "variants": rows,
            "accuracy_spread_points": spread,
            "void": spread is not None and spread > args.max_spread,
            "ratios": ratios(rows, model, args),
        }

    log(
        f"\n=== results: {args.clients} clients; per run the median of {args.rounds - args.warmup} rounds after {args.warmup} "
        f"warm-up, per variant the median of {args.repeats} interleaved run(s); ratios: median of the per-repeat ratios; "
        f"matmul limit {limit:.1f} GFLOP/s ==="
    )
    for model, res in results.items():
        log_table(model, res["variants"], limit, log)
        spread = res["accuracy_spread_points"]
        if spread is not None:
            verdict = "VOID: accuracies disagree" if res["void"] else "ok"
            log(
                f"     accuracy spread (max - min over every run): {spread:.2f} points (limit {args.max_spread}) -> {verdict}"
            )
        log_ratios(res, log)
    load_after = os.getloadavg()
    log(
        f"\nload average {load_before[0]:.1f} before, {load_after[0]:.1f} after; {time.monotonic() - started:.0f} s in all"
    )

    for res in results.values():  # keep the JSON small: no tensors, no per-round engine extras
        for row in res["variants"].values():
            for run in row["runs"]:
                run.pop("final_path", None)
                run.pop("extra", None)
    env = {
        "load_average_before": load_before,
        "load_average_after": load_after,
        "glibc_tunables": MALLOC_TUNABLES if args.malloc_tunables else os.environ.get("GLIBC_TUNABLES", ""),
    }
    write_results(
        args,
        {"variants": variants},
        env,
        {"matmul_gflops": limit, "results": results, "table": lines, "wall_s": time.monotonic() - started},
    )
    if work_ctx:
        work_ctx.cleanup()


def write_results(
    args: argparse.Namespace, config: dict[str, Any], env: dict[str, Any], rest: dict[str, Any]
) -> None:
    """Writes ``args.out``: the options (plus ``config``), the environment (plus ``env``) and ``rest``."""
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"}
    base = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    payload = {"config": {**options, **config}, "environment": {**base, **env}, **rest}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
