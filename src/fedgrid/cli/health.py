"""``fedgrid health``: is a coordinator serving (``fedgrid.ops.health``, which defines the flags)."""

from __future__ import annotations

from fedgrid.ops.health import add_parser
from fedgrid.ops.health import command as run

__all__ = ["add_parser", "run"]
