"""Codec micro-benchmark: size ratio, error and encode/decode throughput of every codec on a model.

For each codec spec it encodes and decodes the same float32 tensors, one after another as a
client's uplink does, and reports:

- ``ratio``: raw bytes / payload bytes (payload = exactly what goes in ``Chunk.data``);
- ``rel_err``: ``||x - decode(encode(x))|| / ||x||`` over all the tensors;
- ``enc GB/s`` and ``dec GB/s``: raw tensor bytes (10^9) per second of wall time, median of
  the repeats;
- ``enc cpu`` and ``dec cpu``: the same per second of the thread's CPU time (``time.thread_time``),
  best of the repeats: what one core does when it is not shared. On the shared 2-core VM, at a
  load average of 10-20, wall time is mostly waiting for the core and swings 2-5x run to run;
- ``goal``: the encode rate issue 40 asks of the codec on one core (fp4, int4 and int8 1 GB/s;
  sparseloco and demo 0.3 GB/s), and whether ``enc cpu`` meets it.

The default tensors are model-like: ``--params`` (100M) float32 parameters as the layers of a
Llama-style decoder of width 1024 (attention 4 x 1024^2, MLP 3 x 1024 x 2816, two norms), with
a 32000 x 1024 embedding and output head, Gaussian values scaled like an outer gradient.
``--shape`` measures one tensor instead (1024,1024 is the older single-tensor table).

Repetitions are interleaved across codecs (the order rotates each time), so background load
hits all of them alike; read the ratios between rows rather than absolute rates on a shared
machine, and note the load average printed beside them. Torch runs single-threaded by default
(``--threads``): on a loaded 2-core VM, multi-threaded elementwise kernels wait on the busy
core and time 10-50x slower.

    python benchmarks/codecs.py                          # 100M parameters, every codec: ~10 min
    python benchmarks/codecs.py --specs int8,int4,fp4 --params 20e6 --repeats 3
    python benchmarks/codecs.py --shape 1024,1024 --repeats 7 --out /tmp/codecs.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fedgrid.compression import get_codec

__all__ = ["main", "run_benchmark", "model_shapes", "DEFAULT_SPECS", "ENCODE_GOALS_GB_S"]

DEFAULT_SPECS = (
    "none",
    "fp16",
    "bf16",
    "int8",
    "int4",
    "fp4",
    "qsgd:127",
    "qsgd:7",
    "topk:0.01",
    "randk:0.01",
    "powersgd:4",
    "sign",
    "sparseloco",
    "demo",
    "none+zstd",
    "int8+zstd",
    "topk:0.01+zstd",
)

#: Encode GB/s on one core that issue 40 asks of these codec families.
ENCODE_GOALS_GB_S = {"int8": 1.0, "int4": 1.0, "fp4": 1.0, "sparseloco": 0.3, "demo": 0.3}


def model_shapes(params: int, width: int = 1024, vocab: int = 32000) -> list[tuple[int, ...]]:
    """Tensor shapes of a Llama-style decoder of about ``params`` parameters (at least one layer)."""
    hidden = 2816  # ~ 8/3 x width, rounded to a multiple of 256, as Llama's MLPs
    layer = [(width, width)] * 4 + [(hidden, width), (hidden, width), (width, hidden), (width,), (width,)]
    per_layer = sum(torch.Size(s).numel() for s in layer)
    ends = [(vocab, width), (width,), (vocab, width)]
    fixed = sum(torch.Size(s).numel() for s in ends)
    layers = max(1, round((params - fixed) / per_layer))
    return ends[:1] + layer * layers + ends[1:]


def run_benchmark(
    specs: tuple[str, ...], shapes: list[tuple[int, ...]], repeats: int, seed: int = 0
) -> list[dict[str, Any]]:
    """Measures every spec on the same Gaussian float32 tensors of ``shapes``; one row per spec."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(shape, generator=gen) * 1e-3 for shape in shapes]
    raw = sum(t.numel() * t.element_size() for t in tensors)
    codecs = {spec: get_codec(spec) for spec in specs}
    enc_s: dict[str, list[float]] = {s: [] for s in specs}
    dec_s: dict[str, list[float]] = {s: [] for s in specs}
    enc_cpu: dict[str, list[float]] = {s: [] for s in specs}
    dec_cpu: dict[str, list[float]] = {s: [] for s in specs}
    sizes: dict[str, int] = {}
    err: dict[str, float] = {}
    for rep in range(repeats + 1):  # repetition 0 warms up (and measures size and error)
        order = specs[rep % len(specs) :] + specs[: rep % len(specs)]
        for spec in order:
            codec = codecs[spec]
            enc = dec = cpu_enc = cpu_dec = 0.0
            size = 0
            sq_err = 0.0
            for x in tensors:
                c0, t0 = time.thread_time(), time.perf_counter()
                payload = codec.encode(x, generator=gen)
                c1, t1 = time.thread_time(), time.perf_counter()
                y = codec.decode(payload, dtype=x.dtype, shape=tuple(x.shape))
                c2, t2 = time.thread_time(), time.perf_counter()
                enc, dec, size = enc + t1 - t0, dec + t2 - t1, size + len(payload)
                cpu_enc, cpu_dec = cpu_enc + c1 - c0, cpu_dec + c2 - c1
                if not rep:
                    sq_err += float((x - y).double().pow(2).sum())
                del payload, y
            if rep:
                enc_s[spec].append(enc)
                dec_s[spec].append(dec)
                enc_cpu[spec].append(cpu_enc)
                dec_cpu[spec].append(cpu_dec)
            else:
                sizes[spec] = size
                err[spec] = (sq_err / sum(float(t.double().pow(2).sum()) for t in tensors)) ** 0.5
    rows = []
    for spec in specs:
        family = spec.split(":")[0].split("+")[0]
        goal = ENCODE_GOALS_GB_S.get(family) if "+" not in spec else None
        encode_cpu_gb_s = raw / 1e9 / min(enc_cpu[spec])
        rows.append(
            {
                "codec": spec,
                "payload_bytes": sizes[spec],
                "ratio": raw / sizes[spec],
                "rel_err": err[spec],
                "encode_gb_s": raw / 1e9 / statistics.median(enc_s[spec]),
                "decode_gb_s": raw / 1e9 / statistics.median(dec_s[spec]),
                "encode_cpu_gb_s": encode_cpu_gb_s,
                "decode_cpu_gb_s": raw / 1e9 / min(dec_cpu[spec]),
                "encode_goal_gb_s": goal,
                "meets_goal": None if goal is None else encode_cpu_gb_s >= goal,
                "encode_s": enc_s[spec],
                "decode_s": dec_s[spec],
                "encode_cpu_s": enc_cpu[spec],
                "decode_cpu_s": dec_cpu[spec],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--specs", default=",".join(DEFAULT_SPECS), help="comma-separated codec specs")
    parser.add_argument("--params", type=float, default=100e6, help="parameters of the model-like tensors")
    parser.add_argument("--shape", default="", help="one tensor of this shape instead, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "codecs.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    specs = tuple(s for s in args.specs.split(",") if s)
    shapes = [tuple(int(d) for d in args.shape.split(","))] if args.shape else model_shapes(int(args.params))
    params = sum(torch.Size(s).numel() for s in shapes)
    load_before = os.getloadavg()
    rows = run_benchmark(specs, shapes, args.repeats)
    load_after = os.getloadavg()
    print(f"{params / 1e6:.1f}M float32 parameters in {len(shapes)} tensors, {args.threads} thread(s)")
    print(
        f"{'codec':<16}{'bytes':>12}{'ratio':>8}{'rel_err':>9}{'enc GB/s':>10}{'dec GB/s':>10}"
        f"{'enc cpu':>9}{'dec cpu':>9}  goal (enc cpu)"
    )
    for r in rows:
        goal = "" if r["encode_goal_gb_s"] is None else f"{r['encode_goal_gb_s']:.1f} "
        goal += "" if r["meets_goal"] is None else ("met" if r["meets_goal"] else "MISSED")
        print(
            f"{r['codec']:<16}{r['payload_bytes']:>12}{r['ratio']:>8.2f}{r['rel_err']:>9.4f}"
            f"{r['encode_gb_s']:>10.3f}{r['decode_gb_s']:>10.3f}"
            f"{r['encode_cpu_gb_s']:>9.3f}{r['decode_cpu_gb_s']:>9.3f}  {goal}"
        )
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {"params": params, "shapes": [list(s) for s in shapes], "repeats": args.repeats}
    config["threads"] = args.threads
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
    }
    out.write_text(json.dumps({"config": config, "environment": env, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
