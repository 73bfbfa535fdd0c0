"""``python -m fedgrid.cli``: the ``fedgrid`` command (what torchrun and the launcher start)."""

from fedgrid.cli import entry

entry()
