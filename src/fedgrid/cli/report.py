"""``fedgrid report``: plots of run directories (``fedgrid.ops.report``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    rep = sub.add_parser("report", help="plot run directories: PNG files and one self-contained HTML page")
    rep.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="run directories (metrics.jsonl), overlaid in one plot per metric",
    )
    rep.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="where the PNGs and report.html go (default: RUN_DIR/report for one run, ./report for several)",
    )
    rep.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="NAME",
        help="the legend name of a run, once per RUN_DIR in order (default: the directory's name)",
    )
    return rep


def run(args: argparse.Namespace) -> int:
    """``fedgrid report``: a bad run directory exits 2 with the file (and line) named."""
    from fedgrid.ops.report import ReportError, load_runs, write_report

    try:
        runs = load_runs(args.runs, args.label)
        import matplotlib  # noqa: F401 - the optional extra: a clear error before any file is written
    except ReportError as exc:
        print(f"fedgrid report: error: {exc}", file=sys.stderr)
        return 2
    except ImportError:
        print(
            "fedgrid report: error: plotting needs matplotlib, which is not installed: pip install 'fedgrid[report]'",
            file=sys.stderr,
        )
        return 2
    if args.out is None:  # beside the run it reports on, not wherever the shell happens to be
        args.out = os.path.join(args.runs[0], "report") if len(args.runs) == 1 else "report"
    try:
        written, notes = write_report(runs, args.out)
    except OSError as exc:
        print(f"fedgrid report: error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"fedgrid report: {note}", file=sys.stderr)
    print(f"fedgrid report: {len(runs)} run(s); wrote {', '.join(str(p) for p in written)}")
    return 0
