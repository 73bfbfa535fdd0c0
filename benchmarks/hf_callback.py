"""The cost of ``fedgrid.integrations.transformers.FederatedCallback`` beside a plain ``Trainer``.

    .venv/bin/python benchmarks/hf_callback.py                 # H = 50, 3 rounds, 5 repeats
    .venv/bin/python benchmarks/hf_callback.py --h 50 --rounds 3 --repeats 5 --out /tmp/hf_callback.json

A tiny Llama (2 layers, width 32, batches of 4 windows of 32 tokens) trains ``rounds * H``
optimizer steps twice per repetition, in alternating order: once as a plain ``Trainer`` (no
callback, nothing synced) and once with the callback as the only client of a DiLoCo coordinator
(``inner_steps = H``, in this process, over gRPC on 127.0.0.1) that syncs every H steps. The
timed window runs from the first step's start to the last step's end (the join and the first pull
are outside it; every sync inside it: upload, the coordinator's outer step, the download). The
overhead is ``federated / plain - 1`` of the mean step time, median over the repetitions. One
intra-op thread. Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch


class _Clock:
    """A TrainerCallback timing the window from the first step's start to the last step's end."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if clock.start is None:
                    clock.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                if clock.mark:
                    clock.after_step()
                clock.end, clock.steps = time.perf_counter(), clock.steps + 1

        class Before(TrainerCallback):  # put before the FederatedCallback: its on_step_end is timed
            def on_step_end(self, args, state, control, **kwargs):
                clock.mark = time.perf_counter()

        self.start: float | None = None
        self.end = self.mark = 0.0
        self.steps = 0
        self.callback = Callback()
        self.before = Before()
        #: Seconds spent between ``before`` and ``callback`` at the steps' ends: the FederatedCallback's step and syncs.
        self.inside = 0.0

    def after_step(self) -> None:
        self.inside += time.perf_counter() - self.mark

    @property
    def per_step(self) -> float:
        assert self.start is not None
        return (self.end - self.start) / self.steps


def _model(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    ).save_pretrained(folder)  # fmt: skip
    return folder


def _trainer(base: Path, out: Path, steps: int, callbacks: list):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    rows = [
        {"input_ids": (ids := torch.randint(3, 128, (32,), generator=g).tolist()), "labels": ids}
        for _ in range(64)
    ]
    args = TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=10_000)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    return Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows), callbacks=callbacks)


def plain(base: Path, work: Path, steps: int) -> float:
    clock = _Clock()
    _trainer(base, work / "plain", steps, [clock.callback]).train()
    return clock.per_step


def federated(base: Path, work: Path, h: int, rounds: int, tau: int = 0) -> tuple[float, float]:
    from fedgrid.cli import serve
    from fedgrid.config import load_config
    from fedgrid.integrations.transformers import FederatedCallback

    out = Path(tempfile.mkdtemp(dir=work))
    config = load_config(overrides={
        "model": f"hf:{base}", "strategy": "diloco", "inner_steps": h, "sync_delay_steps": tau, "rounds": rounds, "clients": 1,
        "min_clients": 1, "listen": "127.0.0.1:0", "threads": 1, "progress": False, "out": str(out)})  # fmt: skip
    coordinator = threading.Thread(target=serve, args=(config,), daemon=True)
    coordinator.start()
    address = out / "address"
    deadline = time.monotonic() + 60
    while not (address.exists() and address.read_text().strip()):
        if time.monotonic() > deadline:
            raise TimeoutError("the coordinator did not start")
        time.sleep(0.02)
    clock = _Clock()
    callback = FederatedCallback(address.read_text().strip(), name="bench", verbose=False)
    _trainer(base, work / "fed", rounds * h + 10, [clock.before, callback, clock.callback]).train()
    coordinator.join(60)
    if (
        clock.steps != rounds * h + tau or callback.federation.rounds != rounds
    ):  # tau: trained during the last sync
        raise RuntimeError(
            f"expected {rounds * h + tau} steps and {rounds} rounds, got {clock.steps}, {callback.federation.rounds}"
        )
    return clock.per_step, clock.inside / (clock.end - clock.start)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="FederatedCallback's cost beside a plain Trainer")
    parser.add_argument("--h", type=int, default=50, help="inner steps between syncs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tau", type=int, default=0, help="sync_delay_steps: overlapped syncs (0: blocking)")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import logging

    logging.getLogger("fedgrid").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = _model(work / "base")
        steps = args.h * args.rounds
        plain(base, work, 10)  # warm-up: imports, first allocations
        runs = []
        for r in range(args.repeats):
            order = ("plain", "federated") if r % 2 == 0 else ("federated", "plain")
            times = {}
            for kind in order:
                if kind == "plain":
                    times["plain"] = plain(base, work, steps)
                else:
                    times["federated"], times["callback_share"] = federated(
                        base, work, args.h, args.rounds, args.tau
                    )
            runs.append({**times, "overhead": times["federated"] / times["plain"] - 1})
    result = {
        "h": args.h,
        "tau": args.tau,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "plain_step_ms": 1e3 * statistics.median(r["plain"] for r in runs),
        "federated_step_ms": 1e3 * statistics.median(r["federated"] for r in runs),
        "overhead": statistics.median(r["overhead"] for r in runs),
        # Best-of per variant: the machine's noise only ever adds time.
        "plain_best_ms": 1e3 * min(r["plain"] for r in runs),
        "federated_best_ms": 1e3 * min(r["federated"] for r in runs),
        "overhead_best": min(r["federated"] for r in runs) / min(r["plain"] for r in runs) - 1,
        # The callback's own time (its step and every sync) as a share of the federated run's window,
        # measured inside one run, so the noise between runs does not enter it.
        "callback_share": statistics.median(r["callback_share"] for r in runs),
        "runs": runs,
        "torch": torch.__version__,
    }
    print(
        f"| H | tau | plain ms/step | federated ms/step | overhead (median of {args.repeats}) | best-of overhead | callback's share of the steps' time |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {args.h} | {args.tau} | {result['plain_step_ms']:.2f} | {result['federated_step_ms']:.2f} | {100 * result['overhead']:+.1f}% "
        f"| {100 * result['overhead_best']:+.1f}% | {100 * result['callback_share']:.1f}% |"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
