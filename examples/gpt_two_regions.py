"""A character-level GPT trained across two emulated regions with overlapped streaming DiLoCo.

One ``fedgrid coordinator`` (``--strategy streaming-diloco``: each round syncs one of
``--fragments`` fragments of the model, in rotation, with DiLoCo's outer Nesterov step; the
sync overlapped with ``--sync-delay-steps`` inner steps, merged with ``--merge-alpha``) and
one datacenter worker per region (``fedgrid client --region NAME``), each reaching the
coordinator through its own emulated WAN link (``fedgrid.ops.wan.WanRelay``, what
``fedgrid wan`` runs: ``--delay-ms`` each way, ``--rate-mbit`` each way). The workers train
``--model gpt`` (``fedgrid.simulation.language``) on their speaking roles of the Shakespeare
plays, H inner AdamW steps per round; the coordinator evaluates the global model on the held-out
windows and writes the token loss and its perplexity to ``OUT/coordinator/metrics.jsonl``, with
the share of their time the workers computed (``utilization``, docs/monitoring.rst).

Data: ``gutenberg-texts.tar.gz`` in ``--data-dir`` (default ``../shared/data/shakespeare``
beside the repository; docs/simulation.rst's datasets table says what the file is). Without it
the example stops before it starts a process, naming the folder.

Run: ``python examples/gpt_two_regions.py [--rounds 6] [--inner-steps 50] [--out runs/gpt-regions]``
(every process on one thread; about two minutes on 2 cores shared with other work, of which
the processes' start and the first round take one). Prints each round's held-out loss (nats
per character; ln 80 = 4.38 for a uniform guess, 3.13 for the characters' unigram
frequencies), perplexity and the workers' utilization, and the WAN bytes: measured, 3.40
after round 1 and 2.34 (perplexity 10.4) after round 6, 6.0 MB over the two links, the
workers computing 56-72% of their time from round 2 on (the rest is mostly the coordinator's
evaluation between rounds, which the next round's tasks wait for: ``--eval-every`` on the
coordinator skips it; see ``benchmarks/goodput.py`` for the link alone).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from fedgrid.ops.wan import WanLink, WanRelay
from fedgrid.runlog import read_metrics

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "shakespeare"
FEDGRID = [sys.executable, "-m", "fedgrid.cli"]
REGIONS = ("us-east", "eu-west")


def start(args: list[str], log: Path) -> subprocess.Popen:
    """A ``fedgrid`` command on one torch thread, its output in ``log``."""
    return subprocess.Popen(
        [*FEDGRID, *args, "--threads", "1"], stdout=log.open("w"), stderr=subprocess.STDOUT
    )


def address(run_dir: Path, proc: subprocess.Popen, timeout_s: float = 120.0) -> str:
    """The address the coordinator writes to ``RUN_DIR/address`` once it listens."""
    deadline = time.monotonic() + timeout_s
    path = run_dir / "address"
    while not (path.exists() and path.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the coordinator wrote no address; see {run_dir.parent / 'coordinator.log'}")
        time.sleep(0.05)
    return path.read_text().strip()


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        description="A GPT over two emulated regions with streaming DiLoCo.", allow_abbrev=False
    )
    p.add_argument("--data-dir", default=str(DEFAULT_DATA), help="folder holding gutenberg-texts.tar.gz")
    p.add_argument("--model", default="gpt", help="gpt, gpt:layers=L,heads=H,dim=D,context=T or hf:PATH")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--inner-steps", type=int, default=50, help="DiLoCo's H: inner steps per round")
    p.add_argument("--inner-lr", type=float, default=3e-3, help="the workers' AdamW learning rate")
    p.add_argument("--fragments", type=int, default=2, help="streaming DiLoCo's fragments")
    p.add_argument(
        "--sync-delay-steps",
        type=int,
        default=None,
        help="tau: inner steps a worker trains while its sync is in flight (default: half of --inner-steps)",
    )
    p.add_argument(
        "--merge-alpha", type=float, default=0.5, help="share of its own values a worker keeps at the merge"
    )
    p.add_argument("--delay-ms", type=float, default=40.0, help="each WAN link's one-way delay")
    p.add_argument("--rate-mbit", type=float, default=10.0, help="each WAN link's rate, each way")
    p.add_argument("--precision", default="auto", help="auto (bf16 on CUDA with bf16), bf16 or fp32")
    p.add_argument("--out", default="runs/gpt-regions")
    args = p.parse_args(argv)
    if not (Path(args.data_dir) / "gutenberg-texts.tar.gz").is_file():
        p.error(
            f"--data-dir {args.data_dir} is not a folder holding gutenberg-texts.tar.gz "
            "(the Shakespeare plays: see docs/simulation.rst's datasets table)"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tau = args.inner_steps // 2 if args.sync_delay_steps is None else args.sync_delay_steps
    data = ["--dataset", "shakespeare", "--data-dir", args.data_dir, "--model", args.model]
    strategy = [
        *("--strategy", "streaming-diloco", "--num-fragments", str(args.fragments)),
        *("--inner-steps", str(args.inner_steps), "--inner-lr", str(args.inner_lr)),
        # Overlapped syncs: each worker hands its fragment to the network and trains tau more
        # steps before it merges the new global fragment (alpha of its own values kept).
        *("--sync-delay-steps", str(tau), "--merge-alpha", str(args.merge_alpha)),
    ]
    coordinator = start(
        [
            "coordinator", *data, *strategy, "--rounds", str(args.rounds), "--min-clients", str(len(REGIONS)),
            "--precision", args.precision, "--listen", "127.0.0.1:0", "--out", str(out / "coordinator"),
        ],
        out / "coordinator.log",
    )  # fmt: skip
    procs, relays = [coordinator], []
    try:
        target = address(out / "coordinator", coordinator)
        for i, region in enumerate(REGIONS):
            link = WanLink(delay_ms=args.delay_ms, rate_mbit=args.rate_mbit, seed=i)
            relays.append(WanRelay(target, link=link).start())  # this region's link to the coordinator
            procs.append(
                start(
                    [
                        "client",
                        *data,
                        "--precision",
                        args.precision,
                        "--coordinator",
                        relays[-1].address,
                        "--region",
                        region,
                        "--partition",
                        f"{i}/{len(REGIONS)}",
                    ],
                    out / f"{region}.log",
                )  # fmt: skip
            )
        for proc in procs:
            if proc.wait(timeout=3600) != 0:
                raise RuntimeError(f"{proc.args[3]} exited with {proc.returncode}; see the logs in {out}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for relay in relays:
            relay.stop()
    rows = read_metrics(out / "coordinator")
    for row in rows:
        print(
            f"round {row['round']:3d}: held-out loss {row['loss']:.4f} nats/char, perplexity "
            f"{row['perplexity']:.2f}, {row['wall_s']:.1f} s, workers computing "
            f"{row.get('utilization', 0.0):.0%} of their time",
            flush=True,
        )
    wan = sum(r.bytes_up + r.bytes_down for r in relays)
    print(f"WAN: {wan / 1e6:.2f} MB over {len(relays)} links; run directories under {out}")
    return rows


if __name__ == "__main__":
    main()
