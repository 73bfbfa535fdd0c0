"""The ``fedgrid`` command, one module per subcommand: ``simulate``, ``coordinator``, ``region``,
``client``, ``certs`` (the CA for mutual TLS), ``report`` (plots of run directories), ``export``
(a ``--peft`` run's model as Hugging Face or PEFT files), ``new``
(an app template), ``status`` (a running coordinator), ``wan`` (an emulated WAN link),
``health`` (is it serving) and ``launch`` (a whole topology as local processes).

Each module has ``add_parser(sub)`` and ``run(args) -> int``; ``main`` maps errors to exit
statuses in one place: 2 for bad input (a ``ConfigError``), 1 for a failure at run time, and
128 + the signal for a run that Ctrl-C or SIGTERM stopped (130, 143; ``fedgrid.interrupts``).

A process that a signal stopped (``entry``: the ``fedgrid`` command, ``python -m fedgrid.cli``)
exits as soon as the command returns: its files are written and closed by then, and the
interpreter's teardown of torch, grpc and transformers would take seconds more on a busy
machine (issue 40: a stop ends a process within 5 s).

A command's module is imported only when that command runs (or ``build_parser()`` builds every
one, for ``fedgrid --help``): the training commands' flags come from ``fedgrid.config``, which
imports torch (about 2 s), and ``fedgrid certs``, ``health`` and ``status`` need none of it
(tests/e2e/test_import_cost.py pins that).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Sequence

from fedgrid.cli.support import FedgridParser, error_line, package_version
from fedgrid.errors import ConfigError, FedgridError
from fedgrid.interrupts import FORCED_EXIT_STATUS, forget_stop, stop_status
from fedgrid.lazy import exports

if TYPE_CHECKING:  # re-exported lazily (__getattr__ below): each imports torch
    from fedgrid.cli.coordinator import serve
    from fedgrid.cli.simulate import SimulateProgress
    from fedgrid.cli.support import CLIENT_CONFIG_KEYS, COORDINATOR_KEYS, REGION_KEYS, SIMULATE_KEYS

__all__ = [
    "main",
    "entry",
    "build_parser",
    "serve",
    "SimulateProgress",
    "SIMULATE_KEYS",
    "COORDINATOR_KEYS",
    "REGION_KEYS",
    "CLIENT_CONFIG_KEYS",
]

__getattr__, __dir__ = exports(
    __name__,
    {
        "serve": "fedgrid.cli.coordinator",
        "SimulateProgress": "fedgrid.cli.simulate",
        "SIMULATE_KEYS": "fedgrid.cli.support",
        "COORDINATOR_KEYS": "fedgrid.cli.support",
        "REGION_KEYS": "fedgrid.cli.support",
        "CLIENT_CONFIG_KEYS": "fedgrid.cli.support",
    },
    globals_=globals(),
)

#: The subcommands in ``--help``'s order (each a module of this package, with ``add_parser`` and ``run``).
COMMANDS = (
    "simulate",
    "coordinator",
    "region",
    "client",
    "certs",
    "report",
    "export",
    "new",
    "status",
    "wan",
    "health",
    "launch",
)
#: Commands that print what they did (the services log what they do).
QUIET = ("simulate", "certs", "report", "export", "new", "status", "health", "launch")


def command_module(name: str) -> ModuleType:
    """The module of the subcommand ``name`` (imported on first use)."""
    return importlib.import_module(f"{__name__}.{name}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """``fedgrid``'s parser: every subcommand, or ``only`` that one (what ``main`` runs, so a
    command imports no other command's module)."""
    parser = FedgridParser(prog="fedgrid", description="Federated training for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"fedgrid {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS if only is None else (only,):
        command_module(name).add_parser(sub)
    return parser


def _command_named(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` runs, when its first word names one (the top-level flags, ``-v``,
    ``--version`` and ``-h``, take no value); ``None`` for anything else: a bare ``fedgrid``,
    ``--help`` or a misspelt command, which the whole parser answers."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # gRPC's core writes its own error lines to stderr (a port taken: "add_port.cc:83] Failed to
    # add port"; a refused client: "ssl_transport_security.cc:2563] Handshake failed"), naming
    # neither the peer nor the fix. fedgrid reports what the user can act on as one line of its
    # own; GRPC_VERBOSITY=ERROR (or DEBUG) in the environment brings the core's lines back.
    # Set before any command imports grpc, which reads it once.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    args = build_parser(_command_named(argv)).parse_args(argv)
    level = logging.DEBUG if args.verbose else (logging.WARNING if args.command in QUIET else logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    forget_stop()
    try:
        status = int(command_module(args.command).run(args))
        # A run that a signal stopped, however cleanly, did not do what was asked.
        stopped = stop_status()
        return stopped if status == 0 and stopped is not None else status
    except ConfigError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    except (FedgridError, OSError) as exc:  # an RPC that failed, a port taken, a file unreadable
        print(error_line(exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before a command installed its own handling (loading data, building a model)
        print(f"fedgrid {args.command}: interrupted", file=sys.stderr)
        return FORCED_EXIT_STATUS


def entry() -> None:
    """The ``fedgrid`` command: ``main``, then the process's exit; at once (``os._exit``, after
    flushing the log and the standard streams) when a signal stopped the command, since it
    has written and closed its files by then (module docstring)."""
    status = main()
    if stop_status() is not None:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more to say
                pass
        os._exit(status)
    sys.exit(status)
