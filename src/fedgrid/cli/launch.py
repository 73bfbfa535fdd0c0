"""``fedgrid launch``: a whole topology as local processes (``fedgrid.ops.launch``, which defines the flags)."""

from __future__ import annotations

from fedgrid.ops.launch import add_parser
from fedgrid.ops.launch import command as run

__all__ = ["add_parser", "run"]
