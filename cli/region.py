"""``fedgrid region``: coordinate a region's clients and join the global coordinator as one client."""

from __future__ import annotations

import argparse
from typing import Any

from fedgrid.cli.support import REGION_KEYS, add_config_flags, config_from

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    region = sub.add_parser(
        "region", help="coordinate a region's clients and join the global coordinator as one client"
    )
    add_config_flags(region, REGION_KEYS)
    return region


def run(args: argparse.Namespace) -> int:
    from fedgrid.region import run_region

    run_region(config_from(args, REGION_KEYS))
    return 0
