"""The kernel's link against ``fedgrid wan``'s: the same TCP transfer across a lab link shaped by
``tbf`` (and iptables' loss), and across an unshaped lab link through ``fedgrid wan`` at the
same rate (and loss), side by side (``fedgrid.ops.lab``; needs root).

Each row is one rate and loss; each transfer carries about ``--seconds`` of the rate, and the
two variants alternate ``--repeats`` times (medians: the machine is shared). ``ratio`` is the
kernel's wall time over the relay's. Run: ``sudo .venv/bin/python benchmarks/lab_links.py``;
writes ``benchmarks/results/lab_links.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

from fedgrid.ops.lab import Lab, transfer_s, unavailable

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="5,20,50", help="Mbit/s, comma-separated (default 5,20,50)")
    parser.add_argument(
        "--losses", default="0,0.005", help="loss probabilities, comma-separated (default 0,0.005)"
    )
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="each transfer's length at its rate (default 2)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="transfers of each variant (default 5)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lab_links.json")
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason is not None:
        print(f"no lab here: {reason}", file=sys.stderr)
        return 2
    rows = []
    print(f"{'Mbit/s':>6} {'loss':>6} {'MB':>5} | {'ideal s':>7} {'tbf s':>7} {'wan s':>7} {'tbf/wan':>7}")
    for rate in (float(r) for r in args.rates.split(",")):
        for loss in (float(p) for p in args.losses.split(",")):
            size = int(rate * 1e6 / 8 * args.seconds)
            with Lab() as lab:
                src, shaped, plain = lab.host("sender"), lab.host("shaped"), lab.host("plain")
                lab.link(src, shaped, rate_mbit=rate, loss=loss)
                lab.link(src, plain)
                kernel, relay = [], []
                for i in range(args.repeats):
                    kernel.append(transfer_s(src, shaped, size))
                    relay.append(
                        transfer_s(src, plain, size, relay={"rate_mbit": rate, "loss": loss, "seed": i})
                    )
            row = {
                "rate_mbit": rate,
                "loss": loss,
                "bytes": size,
                "ideal_s": size * 8 / (rate * 1e6),
                "tbf_s": statistics.median(kernel),
                "wan_s": statistics.median(relay),
                "tbf_runs": kernel,
                "wan_runs": relay,
            }
            row["ratio"] = row["tbf_s"] / row["wan_s"]
            rows.append(row)
            print(
                f"{rate:>6g} {loss:>6g} {size / 1e6:>5.1f} | {row['ideal_s']:>7.2f} {row['tbf_s']:>7.2f} "
                f"{row['wan_s']:>7.2f} {row['ratio']:>7.3f}",
                flush=True,
            )
    report = {
        "benchmark": "lab_links",
        "args": {k: str(v) for k, v in vars(args).items()},
        "environment": {
            "python": platform.python_version(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
