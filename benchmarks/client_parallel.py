"""A client's local training throughput on 1 and 2 ranks, and (on a GPU) its model FLOPs utilization.

**CPU** (gloo): local samples per second of ``ParallelClient.fit`` with 1 rank and with 2
ranks, every rank on one torch thread, and the scaling ratio (2 ranks / 1 rank; 2.0 is
perfect). A rank-1 run of one thread is the baseline because the 2 ranks use one core
each; the 1-rank, 2-thread figure is printed beside it for what one process gets from both
cores. Each configuration starts its ranks once, trains one untimed warm-up fit, then
``--repeats`` timed fits, interleaved across configurations; the table shows medians. The
model is a 784-1024-1024-10 MLP (about 1.9M parameters) on synthetic Fashion-MNIST-shaped
data, batch 256 (the global batch: each of 2 ranks trains 128 rows of it).

**GPU** (``--gpu``, on a machine with CUDA): one local training step of a GPT-2-small-sized
decoder (124M parameters, 12 layers, width 768, context 1024, bf16 autocast) on one
GPU, timed over ``--gpu-steps`` steps after warm-up; MFU = achieved FLOP/s over the chip's
bf16 dense peak (``--peak-tflops``, default 989 for an H100/H200 SXM). FLOPs per token are
6 N + 12 L T d (the PaLM appendix's count: the weights' matmuls forward and backward, plus
attention). The step is the one ``TorchClient`` runs (forward, loss, backward, optimizer
step), with ``torch.compile`` and fused AdamW.

Run: ``python benchmarks/client_parallel.py [--repeats 3] [--steps 40]`` (CPU), ``python
benchmarks/client_parallel.py --gpu`` (GPU). Writes ``benchmarks/results/client_parallel.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the spawned ranks import this module

from fedgrid.client import TorchClient  # noqa: E402
from fedgrid.client.parallel import ParallelClient, ParallelSpec  # noqa: E402
from fedgrid.types import FitIns  # noqa: E402

BATCH = 256


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def make_client(partition: int, num_partitions: int, seed: int, *, examples: int = 5120) -> TorchClient:
    """The benchmark's client: a factory the ranks import (this module is on their path)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(examples, 1, 28, 28, generator=g), torch.randint(0, 10, (examples,), generator=g)
    return TorchClient(
        mlp(),
        DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True),
        nn.functional.cross_entropy,
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        device="cpu",
        name=f"bench-{partition}",
        seed=seed,
    )


def cpu(repeats: int, steps: int) -> list[dict[str, Any]]:
    configs = [("1 rank, 1 thread", 1, 1), ("1 rank, 2 threads", 1, 2), ("2 ranks (dp), 1 thread each", 2, 1)]
    clients = {
        name: ParallelClient(
            make_client, (0, 1, 0), {"examples": steps * BATCH}, spec=ParallelSpec.parse(n, "dp"), threads=t
        )
        for name, n, t in configs
    }
    state = make_client(0, 1, 0, examples=BATCH).model.state_dict()
    times: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    try:
        for name, client in clients.items():
            client.fit(state, FitIns(round=0, config={"local_epochs": 1}))  # starts the ranks; warms up
        for r in range(repeats):
            for name, client in clients.items():
                started = time.perf_counter()
                out = client.fit(state, FitIns(round=r + 1, config={"local_epochs": 1}))
                times[name].append(time.perf_counter() - started)
                assert out.num_examples == steps * BATCH
    finally:
        for client in clients.values():
            client.close()
    rows = []
    for name, n, threads in configs:
        median = statistics.median(times[name])
        rows.append(
            {
                "config": name,
                "ranks": n,
                "threads_per_rank": threads,
                "fit_s": times[name],
                "median_fit_s": median,
                "samples_per_s": steps * BATCH / median,
            }
        )
    base = rows[0]["samples_per_s"]
    for row in rows:
        row["vs_1_rank_1_thread"] = row["samples_per_s"] / base
    return rows


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = (
            nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            .transpose(1, 2)
            .reshape(b, t, d)
        )
        x = x + self.proj(y)
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2 small: 12 layers, width 768, 12 heads, vocabulary 50304 (tied embedding), context 1024."""

    def __init__(
        self, vocab: int = 50304, d: int = 768, layers: int = 12, heads: int = 12, context: int = 1024
    ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def gpu(steps: int, batch: int, peak_tflops: float) -> dict[str, Any]:
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    model = GPT().to(device)
    params = sum(p.numel() for p in model.parameters())
    layers, d, context = 12, 768, 1024
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    compiled = torch.compile(model)
    idx = torch.randint(0, 50304, (batch, context), device=device)
    targets = torch.randint(0, 50304, (batch, context), device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(compiled(idx).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - started) / steps
    flops_per_token = 6 * params + 12 * layers * context * d
    achieved = flops_per_token * batch * context / elapsed
    return {
        "device": torch.cuda.get_device_name(),
        "parameters": params,
        "batch": batch,
        "context": context,
        "step_s": elapsed,
        "tokens_per_s": batch * context / elapsed,
        "achieved_tflops": achieved / 1e12,
        "peak_tflops": peak_tflops,
        "mfu": achieved / (peak_tflops * 1e12),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed fits per configuration (default 3; the table shows medians)",
    )
    parser.add_argument("--steps", type=int, default=40, help="steps per fit (batches of 256; default 40)")
    parser.add_argument(
        "--gpu", action="store_true", help="measure the GPT-2-small step's MFU on one GPU instead"
    )
    parser.add_argument("--gpu-steps", type=int, default=20)
    parser.add_argument(
        "--gpu-batch", type=int, default=16, help="sequences of 1024 tokens per step (default 16)"
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="the chip's dense bf16 peak (default 989: H100/H200 SXM)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "client_parallel.json")
    args = parser.parse_args(argv)
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "platform": platform.platform(),
    }
    if args.gpu:
        if not torch.cuda.is_available():
            parser.error("--gpu needs CUDA")
        result = gpu(args.gpu_steps, args.gpu_batch, args.peak_tflops)
        print(
            f"{result['device']}: GPT-2 small ({result['parameters'] / 1e6:.0f}M params), batch {result['batch']}x{result['context']}: "
            f"{result['step_s'] * 1e3:.1f} ms/step, {result['tokens_per_s']:.0f} tokens/s, {result['achieved_tflops']:.0f} TFLOP/s, "
            f"MFU {result['mfu']:.1%} (peak {result['peak_tflops']:.0f}), peak memory {result['peak_memory_gib']:.1f} GiB"
        )
        report: dict[str, Any] = {
            "benchmark": "client_parallel",
            "kind": "gpu",
            "environment": env,
            "result": result,
        }
    else:
        rows = cpu(args.repeats, args.steps)
        header = (
            f"{'configuration':<30} | {'median fit s':>12} | {'samples/s':>9} | {'vs 1 rank, 1 thread':>19}"
        )
        print(header)
        print("-" * len(header))
        for row in rows:
            print(
                f"{row['config']:<30} | {row['median_fit_s']:>12.3f} | {row['samples_per_s']:>9.0f} | {row['vs_1_rank_1_thread']:>19.2f}"
            )
        print(f"scaling ratio, 2 ranks / 1 rank (1 thread each): {rows[2]['vs_1_rank_1_thread']:.2f}")
        report = {
            "benchmark": "client_parallel",
            "kind": "cpu",
            "batch": BATCH,
            "steps": args.steps,
            "repeats": args.repeats,
            "model": "MLP 784-1024-1024-10",
            "environment": env,
            "rows": rows,
        }
    out = args.out if not args.gpu else args.out.with_name("client_parallel_gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
