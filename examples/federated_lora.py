"""Federated LoRA fine-tuning of a small Llama on Shakespeare's speaking roles, against local-only
fine-tuning and full-model FedAvg: held-out perplexity and bytes per round.

1. A Llama-architecture model (2 layers, width 64) is built from a local config and pretrained
   briefly (``--pretrain-rounds`` DiLoCo rounds over every role), then saved with its weights.
2. From that base, three fine-tunings of ``--rounds`` rounds over ``--clients`` clients (whole
   speaking roles each), each client ``--steps`` AdamW steps a round:
   - federated LoRA (``--peft lora:r=8,alpha=16,targets=q_proj,v_proj``): only the adapters travel;
   - local-only LoRA: each client fine-tunes its own adapters and never shares them (the mean of
     the clients' held-out perplexities);
   - full-model FedAvg: every weight travels.
   FedAvg here is DiLoCo with outer lr 1 and no momentum: the average of the clients' models
   after ``--steps`` local steps.
3. Peak client memory of one fit (3 steps of 128 windows) with and without gradient checkpointing:
   a child process each, its peak resident size (``VmHWM``, reset just before the fit) above its
   resident size then (Linux).

Data: ``gutenberg-texts.tar.gz`` in ``--data-dir`` (default ``../shared/data/shakespeare``).
Nothing is downloaded. Run: ``python examples/federated_lora.py [--rounds 4] [--clients 4]``
(a few minutes on 2 cores). Prints a table and returns it from ``main``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
from pathlib import Path

import torch

from fedgrid.config import load_config
from fedgrid.runlog import read_metrics
from fedgrid.simulation.language import build_lm, lm_spec
from fedgrid.simulation.run import run_simulation
from fedgrid.simulation.tasks import builtin_client, client_options, make_evaluate
from fedgrid.types import FitIns

PEFT = "lora:r=8,alpha=16,targets=q_proj,v_proj"


def make_base(folder: Path, data_dir: str, rounds: int, steps: int, threads: int) -> Path:
    """The base model: a small Llama config, pretrained ``rounds`` DiLoCo rounds, saved with its weights."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                tie_word_embeddings=False).save_pretrained(folder / "config")
    final, _ = run_simulation(load_config(overrides={
        "dataset": "shakespeare", "data_dir": data_dir, "model": f"hf:{folder / 'config'}",
        "strategy": "diloco", "clients": 4, "rounds": rounds, "inner_steps": steps, "inner_lr": 3e-3,
        "threads": threads, "progress": False, "eval_every": rounds}))
    model = build_lm(lm_spec(f"hf:{folder / 'config'}"))
    model.load_state_dict(final)
    model.net.save_pretrained(folder / "base")
    return folder / "base"


def options(base: Path, data_dir: str, args, **more) -> dict:
    return {"dataset": "shakespeare", "data_dir": data_dir, "model": f"hf:{base}", "clients": args.clients,
            "rounds": args.rounds, "strategy": "diloco", "outer_lr": 1.0, "outer_momentum": 0.0,
            "inner_steps": args.steps, "inner_lr": args.lr, "threads": args.threads, "progress": False,
            "seed": 1, **more}


def federated(base: Path, data_dir: str, args, out: Path, peft: str) -> tuple[float, dict]:
    """Held-out perplexity after the run, and its metrics.jsonl's last row."""
    run_simulation(load_config(overrides=options(base, data_dir, args, peft=peft, out=str(out))))
    row = read_metrics(out)[-1]
    return row["perplexity"], row


def local_only(base: Path, data_dir: str, args) -> float:
    """Each client fine-tunes its own adapters for the same steps; the mean held-out perplexity."""
    config = load_config(overrides=options(base, data_dir, args, peft=PEFT))
    evaluate = make_evaluate("shakespeare", config.model, data_dir, peft=PEFT)
    perplexities = []
    for i in range(args.clients):
        client = builtin_client(i, args.clients, config.seed, client_options(config))
        state = {k: v.clone() for k, v in client.model.state_dict().items()}
        for r in range(1, args.rounds + 1):
            task = {"algorithm": "diloco", "inner_steps": args.steps, "lr": args.lr, "seed": 1, "round": r}
            state = dict(client.fit(state, FitIns(round=r, config=task)).state)
        perplexities.append(evaluate(state)[1]["perplexity"])
    return sum(perplexities) / len(perplexities)


def _status_bytes(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (the peak since the last reset) of this process, in bytes (Linux)."""
    line = next(row for row in open("/proc/self/status") if row.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _fit_peak(base: str, data_dir: str, checkpointing: bool, queue) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    config = load_config(overrides={"dataset": "shakespeare", "data_dir": data_dir, "model": f"hf:{base}",
                                    "peft": PEFT, "batch_size": 128, "grad_checkpointing": checkpointing})
    client = builtin_client(0, 4, 1, client_options(config))
    state = {k: v.clone() for k, v in client.model.state_dict().items()}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size: the peak of the fit alone follows
    before = _status_bytes("VmRSS")
    client.fit(state, FitIns(round=1, config={"algorithm": "diloco", "inner_steps": 3, "lr": 1e-3}))
    queue.put(_status_bytes("VmHWM") - before)


def peak_memory(base: Path, data_dir: str, checkpointing: bool) -> int:
    """Bytes a client's fit (3 steps of 128 windows) adds to its process's peak resident memory."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_fit_peak, args=(str(base), data_dir, checkpointing, queue))
    proc.start()
    peak = queue.get(timeout=600)
    proc.join()
    return peak


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "shakespeare"
    parser.add_argument("--data-dir", default=str(default))
    parser.add_argument("--work", default="federated_lora", help="folder for the models and runs")
    parser.add_argument("--pretrain-rounds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="local AdamW steps per round")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    work = Path(args.work)
    base = make_base(work, args.data_dir, args.pretrain_rounds, 50, args.threads)
    evaluate = make_evaluate("shakespeare", f"hf:{base}", args.data_dir, peft=PEFT)
    client = builtin_client(0, 1, 1, client_options(load_config(overrides=options(base, args.data_dir, args, peft=PEFT))))
    before = evaluate(client.model.state_dict())[1]["perplexity"]  # B = 0: the base itself
    lora, lora_row = federated(base, args.data_dir, args, work / "lora", PEFT)
    full, full_row = federated(base, args.data_dir, args, work / "full", "")
    table = {
        "perplexity_before": before,
        "perplexity_federated_lora": lora,
        "perplexity_local_only_lora": local_only(base, args.data_dir, args),
        "perplexity_full_fedavg": full,
        "bytes_up_per_round_lora": lora_row["bytes_up"],
        "bytes_up_per_round_full": full_row["bytes_up"],
        "bytes_down_per_round_lora": lora_row["bytes_down"],
        "bytes_down_per_round_full": full_row["bytes_down"],
    }
    if args.memory:
        table["peak_fit_bytes_no_checkpointing"] = peak_memory(base, args.data_dir, False)
        table["peak_fit_bytes_checkpointing"] = peak_memory(base, args.data_dir, True)
    for key, value in table.items():
        print(f"{key:34s} {value:,.2f}" if isinstance(value, float) else f"{key:34s} {value:,}")
    return table


if __name__ == "__main__":
    main()
