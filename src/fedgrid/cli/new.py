"""``fedgrid new NAME``: a runnable app template (``fedgrid.ops.new_app``)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    new = sub.add_parser(
        "new", help="write a runnable app template into ./NAME/ (model, client factory, data, config.toml)"
    )
    new.add_argument(
        "name", metavar="NAME", help="the app's package name: a Python identifier, not an existing directory"
    )
    return new


def run(args: argparse.Namespace) -> int:
    from fedgrid.ops.new_app import create_app

    folder = create_app(args.name)
    print(
        f"wrote {folder}/ ({', '.join(sorted(p.name for p in folder.iterdir()))}); run: fedgrid simulate --config {folder}/config.toml"
    )
    return 0
