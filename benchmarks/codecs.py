"""Codec micro-benchmark: size ratio, error and encode/decode throughput of every codec on one tensor.

For each codec spec it encodes and decodes the same float32 tensor (default a 1024 x 1024
Gaussian matrix, so ``powersgd`` compresses it rather than falling back) and reports:

- ``ratio``: raw bytes / payload bytes (payload = exactly what goes in ``Chunk.data``);
- ``rel_err``: ``||x - decode(encode(x))|| / ||x||``;
- ``enc MB/s`` and ``dec MB/s``: raw tensor bytes (10^6) per second, median of the repeats.

Repetitions are interleaved across codecs (the order rotates each time), so background load
hits all of them alike; read the ratios between rows rather than absolute MB/s on a shared
machine. Torch runs single-threaded by default (``--threads``): on a loaded 2-core VM,
multi-threaded elementwise kernels wait on the busy core and time 10-50x slower.

    python benchmarks/codecs.py
    python benchmarks/codecs.py --shape 4096,256 --repeats 5 --out /tmp/codecs.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fedgrid.compression import get_codec

__all__ = ["main", "run_benchmark", "DEFAULT_SPECS"]

DEFAULT_SPECS = (
    "none",
    "fp16",
    "bf16",
    "int8",
    "qsgd:127",
    "qsgd:7",
    "topk:0.01",
    "randk:0.01",
    "powersgd:4",
    "sign",
    "none+zstd",
    "int8+zstd",
    "topk:0.01+zstd",
)


def run_benchmark(
    specs: tuple[str, ...], shape: tuple[int, ...], repeats: int, seed: int = 0
) -> list[dict[str, Any]]:
    """Measures every spec on one Gaussian float32 tensor of ``shape``; returns one row per spec."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    raw = x.numel() * x.element_size()
    codecs = {spec: get_codec(spec) for spec in specs}
    enc_s: dict[str, list[float]] = {s: [] for s in specs}
    dec_s: dict[str, list[float]] = {s: [] for s in specs}
    payloads: dict[str, bytes] = {}
    for rep in range(repeats + 1):  # repetition 0 warms up and is dropped
        order = specs[rep % len(specs) :] + specs[: rep % len(specs)]
        for spec in order:
            codec = codecs[spec]
            t0 = time.perf_counter()
            payload = codec.encode(x, generator=gen)
            t1 = time.perf_counter()
            codec.decode(payload, dtype=x.dtype, shape=shape)
            t2 = time.perf_counter()
            if rep:
                enc_s[spec].append(t1 - t0)
                dec_s[spec].append(t2 - t1)
            payloads[spec] = bytes(payload)
    rows = []
    for spec in specs:
        y = codecs[spec].decode(payloads[spec], dtype=x.dtype, shape=shape)
        rows.append(
            {
                "codec": spec,
                "payload_bytes": len(payloads[spec]),
                "ratio": raw / len(payloads[spec]),
                "rel_err": float((x - y).norm() / x.norm()),
                "encode_mb_s": raw / 1e6 / statistics.median(enc_s[spec]),
                "decode_mb_s": raw / 1e6 / statistics.median(dec_s[spec]),
                "encode_s": enc_s[spec],
                "decode_s": dec_s[spec],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--specs", default=",".join(DEFAULT_SPECS), help="comma-separated codec specs")
    parser.add_argument("--shape", default="1024,1024", help="tensor shape, comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "codecs.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    specs = tuple(s for s in args.specs.split(",") if s)
    shape = tuple(int(d) for d in args.shape.split(","))
    rows = run_benchmark(specs, shape, args.repeats)
    print(f"{'codec':<16}{'bytes':>12}{'ratio':>9}{'rel_err':>9}{'enc MB/s':>10}{'dec MB/s':>10}")
    for r in rows:
        print(
            f"{r['codec']:<16}{r['payload_bytes']:>12}{r['ratio']:>9.2f}{r['rel_err']:>9.4f}"
            f"{r['encode_mb_s']:>10.0f}{r['decode_mb_s']:>10.0f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {"shape": list(shape), "repeats": args.repeats, "threads": args.threads}
    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()}
    out.write_text(json.dumps({"config": config, "environment": env, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
