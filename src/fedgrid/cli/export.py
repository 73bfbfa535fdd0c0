"""``fedgrid export``: a run's fine-tuned language model as Hugging Face or PEFT files
(``fedgrid.simulation.peft_lm.export_run``)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    exp = sub.add_parser(
        "export",
        help="write a --peft run's model: the base with its adapters merged, or the adapter in PEFT's format",
    )
    exp.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (config.toml, model.safetensors)")
    what = exp.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--merged",
        metavar="OUT",
        help="folder for the base model with the adapters merged (loads with AutoModelForCausalLM.from_pretrained)",
    )
    what.add_argument(
        "--adapter",
        metavar="OUT",
        help="folder for the adapter alone in PEFT's format (loads with PeftModel.from_pretrained(base, OUT))",
    )
    return exp


def run(args: argparse.Namespace) -> int:
    """``fedgrid export``: a run directory that is not a ``--peft`` run's is a ``ConfigError`` (exit 2)."""
    from fedgrid.simulation.peft_lm import export_run

    merged = args.merged is not None
    out = export_run(args.run_dir, args.merged if merged else args.adapter, merged=merged)
    print(f"fedgrid export: wrote {'the merged model' if merged else 'the adapter'} to {out}")
    return 0
