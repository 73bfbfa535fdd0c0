"""``fedgrid region``: coordinate a region's clients and join the global coordinator as one client."""

from __future__ import annotations

import argparse
from typing import Any

from fedgrid.cli.support import REGION_KEYS, add_config_flags, config_from

__all__ = ["add_parser", "run", "serve"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    region = sub.add_parser(
        "region", help="coordinate a region's clients and join the global coordinator as one client"
    )
    add_config_flags(region, REGION_KEYS)
    return region


def serve(config: Any, **kwargs: Any) -> int:
    """``run_region`` on ``config``; a ``--peft`` run's region first hashes the frozen base of its
    ``--model hf:PATH`` (``fedgrid.simulation.peft_lm``), which it shows upstream and requires of
    its clients."""
    from fedgrid.region import run_region

    base_hash = ""
    if config.peft and config.model.startswith("hf:"):
        from fedgrid.seeding import RNG_LOCK
        from fedgrid.simulation.catalog import build_model

        with RNG_LOCK:
            model = build_model(
                config.dataset, config.model, config.data_dir, config.peft, config.lora_aggregation
            )
        base_hash = str(getattr(model, "base_hash", ""))
    return run_region(config, base_hash=base_hash, **kwargs)


def run(args: argparse.Namespace) -> int:
    serve(config_from(args, REGION_KEYS))
    return 0
