"""``fedgrid wan``: relay TCP through an emulated WAN link (``fedgrid.ops.wan``)."""

from __future__ import annotations

import argparse
from typing import Any

from fedgrid.ops.wan import add_arguments
from fedgrid.ops.wan import command as run

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    wan = sub.add_parser(
        "wan",
        help="relay TCP to --target through an emulated WAN link (delay, bandwidth, loss); until SIGTERM",
    )
    add_arguments(wan)
    return wan
