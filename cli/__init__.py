"""The ``fedgrid`` command, one module per subcommand: ``simulate``, ``coordinator``, ``region``,
``client``, ``certs`` (the CA for mutual TLS), ``report`` (plots of run directories), ``new``
(an app template), ``status`` (a running coordinator), ``wan`` (an emulated WAN link),
``health`` (is it serving) and ``launch`` (a whole topology as local processes).

Each module has ``add_parser(sub)`` and ``run(args) -> int``; ``main`` maps errors to exit
statuses in one place: 2 for bad input (a ``ConfigError``), 1 for a failure at run time.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from fedgrid.cli import certs, client, coordinator, health, launch, new, region, report, simulate, status, wan
from fedgrid.cli.coordinator import serve
from fedgrid.cli.simulate import SimulateProgress
from fedgrid.cli.support import (
    CLIENT_CONFIG_KEYS,
    COORDINATOR_KEYS,
    REGION_KEYS,
    SIMULATE_KEYS,
    FedgridParser,
    error_line,
    package_version,
)
from fedgrid.errors import ConfigError, FedgridError
from fedgrid.interrupts import FORCED_EXIT_STATUS

__all__ = [
    "main",
    "build_parser",
    "serve",
    "SimulateProgress",
    "SIMULATE_KEYS",
    "COORDINATOR_KEYS",
    "REGION_KEYS",
    "CLIENT_CONFIG_KEYS",
]

#: The subcommands in ``--help``'s order: each module's ``add_parser`` and ``run``.
COMMANDS = {
    "simulate": simulate,
    "coordinator": coordinator,
    "region": region,
    "client": client,
    "certs": certs,
    "report": report,
    "new": new,
    "status": status,
    "wan": wan,
    "health": health,
    "launch": launch,
}
#: Commands that print what they did (the services log what they do).
QUIET = ("simulate", "certs", "report", "new", "status", "health", "launch")


def build_parser() -> argparse.ArgumentParser:
    parser = FedgridParser(prog="fedgrid", description="Federated training for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"fedgrid {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.verbose else (logging.WARNING if args.command in QUIET else logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(COMMANDS[args.command].run(args))
    except ConfigError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    except (FedgridError, OSError) as exc:  # an RPC that failed, a port taken, a file unreadable
        print(error_line(exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before a command installed its own handling (loading data, building a model)
        print(f"fedgrid {args.command}: interrupted", file=sys.stderr)
        return FORCED_EXIT_STATUS
