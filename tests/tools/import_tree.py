"""Lays out the ``fedgrid`` package as Python imports it, for import-linter.

pyproject.toml maps subpackages to top-level folders (``fedgrid.server`` is ``server/``);
grimp, import-linter's graph builder, walks one package folder on disk. This writes
``OUT/fedgrid/`` with a symlink to every module, following that mapping, so that
``PYTHONPATH=OUT lint-imports`` sees the whole package. Files are linked one by one, so a
test can add a module to the tree without touching the repository.

Usage: ``python tests/tools/import_tree.py OUT``
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def build(out: Path, *, root: Path = ROOT) -> Path:
    """Writes the tree of the checkout at ``root`` under ``out`` (replacing it); returns ``out``."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    if out.exists():
        shutil.rmtree(out)
    for package, folder in mapping.items():
        target = out.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for source in sorted((root / folder).glob("*.py")):
            (target / source.name).symlink_to(source)
    return out


if __name__ == "__main__":
    build(Path(sys.argv[1]).resolve())
