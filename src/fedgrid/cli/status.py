"""``fedgrid status ADDRESS``: a running coordinator's round, progress and clients (``fedgrid.ops.watch``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    status = sub.add_parser(
        "status", help="show a running coordinator's round, progress and clients (its --http address)"
    )
    status.add_argument("address", metavar="ADDRESS", help="HOST:PORT of the coordinator's --http server")
    status.add_argument("--watch", action="store_true", help="redraw until Ctrl-C")
    status.add_argument(
        "--interval",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds between redraws with --watch (default 2)",
    )
    status.add_argument(
        "--token-file",
        dest="token_file",
        default="",
        metavar="FILE",
        help="the coordinator's http_token_file",
    )
    return status


def run(args: argparse.Namespace) -> int:
    """``fedgrid status ADDRESS`` (``fedgrid.ops.watch``): one line naming the address when it cannot connect."""
    from fedgrid.ops.watch import StatusUnavailable, status_command

    try:
        return status_command(
            args.address, watch=args.watch, interval=args.interval, token_file=args.token_file
        )
    except StatusUnavailable as exc:
        print(f"fedgrid status: {exc}", file=sys.stderr)
        return 1
