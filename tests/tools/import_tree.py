"""Lays out the ``fedgrid`` package as Python imports it, for import-linter.

Writes ``OUT/fedgrid/`` with a symlink to every module of the checkout's package, so that
``PYTHONPATH=OUT lint-imports`` sees the whole package and a test can add or change a module
in the tree without touching the repository (files are linked one by one). The package is
``src/fedgrid/`` (paths are import names); a checkout from before the src layout (a baseline
revision a benchmark builds) maps subpackages to top-level folders in pyproject.toml's
``[tool.setuptools.package-dir]``, which is followed instead.

Usage: ``python tests/tools/import_tree.py OUT``
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _folders(root: Path) -> dict[str, Path]:
    """Package name -> the folder its modules are in, for the checkout at ``root``."""
    package = root / "src" / "fedgrid"
    if package.is_dir():
        folders = [package, *(p.parent for p in sorted(package.glob("*/__init__.py")))]
        return {".".join(f.relative_to(root / "src").parts): f for f in folders}
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in mapping.items()}


def build(out: Path, *, root: Path = ROOT) -> Path:
    """Writes the tree of the checkout at ``root`` under ``out`` (replacing it); returns ``out``."""
    if out.exists():
        shutil.rmtree(out)
    for package, folder in _folders(root).items():
        target = out.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for source in sorted(folder.glob("*.py")):
            (target / source.name).symlink_to(source)
    return out


if __name__ == "__main__":
    build(Path(sys.argv[1]).resolve())
