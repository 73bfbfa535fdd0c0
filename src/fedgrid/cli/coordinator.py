"""``fedgrid coordinator``: serve rounds to clients over gRPC."""

from __future__ import annotations

import argparse
from typing import Any

from fedgrid.cli.support import COORDINATOR_KEYS, add_config_flags, config_from
from fedgrid.config import Config
from fedgrid.types import ModelState

__all__ = ["add_parser", "run", "serve"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    coord = sub.add_parser("coordinator", help="serve rounds to clients over gRPC")
    add_config_flags(coord, COORDINATOR_KEYS)
    return coord


def serve(config: Config, **kwargs: Any) -> ModelState | None:
    """``fedgrid coordinator``: ``run_coordinator`` with the initial model from an
    ``initial_model`` file or a ``MODULE:FACTORY`` (no dataset code imported), else from
    the built-in dataset's model, with its server-side evaluation; a ``--model hf:PATH`` whose
    sites bring the data (no language-model dataset named) is built alone, without one. ``kwargs`` go to
    ``run_coordinator`` (``ready``, ``on_event``)."""
    from fedgrid.server.serve import coordinator_model, run_coordinator

    initial = coordinator_model(config)
    if initial is not None:
        return run_coordinator(config, initial=initial, **kwargs)
    from fedgrid.simulation.tasks import check_config, resolve, site_data_model, sites_bring_the_data

    if sites_bring_the_data(config.dataset, config.model):  # --model hf:PATH: the sites bring the data
        site = site_data_model(
            model=config.model, seed=config.seed, peft=config.peft, lora_aggregation=config.lora_aggregation
        )
        return run_coordinator(config, initial=site.initial_state, base_hash=site.base_hash, **kwargs)
    check_config(config)
    resolved = resolve(
        dataset=config.dataset,
        model=config.model,
        seed=config.seed,
        data_dir=config.data_dir,
        precision=config.precision,
        peft=config.peft,
        lora_aggregation=config.lora_aggregation,
        eval_batches=config.eval_batches,
        text_column=config.text_column,
    )
    return run_coordinator(
        config,
        initial=resolved.initial_state,
        evaluate_fn=resolved.evaluate,
        base_hash=resolved.base_hash,
        **kwargs,
    )


def run(args: argparse.Namespace) -> int:
    serve(config_from(args, COORDINATOR_KEYS))
    return 0
