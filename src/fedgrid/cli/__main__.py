"""``python -m fedgrid.cli``: the ``fedgrid`` command (what torchrun and the launcher start)."""

import sys

from fedgrid.cli import main

sys.exit(main())
