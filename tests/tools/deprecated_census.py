"""Counts the deprecated aliases of the ``fedgrid`` that Python imports (issue 39: "deprecated aliases 0").

An alias counts once for each name a module serves with a ``DeprecationWarning`` (the tables a
module-level ``__getattr__`` closes over, and the old ``run`` / ``start`` / ``GrpcFleet``), each
module whose import warns, and each old keyword in ``fedgrid.aggregation.fedavg``'s
``LEGACY_SAMPLING_KEYWORDS``. Run it on another revision's source with ``PYTHONPATH=REV/src``.

Usage: ``python tests/tools/deprecated_census.py`` (prints a count per module, then the total)
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings
from types import ModuleType
from typing import Callable

import fedgrid


def _warns(action: Callable[[], object]) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            action()
        except AttributeError:
            return False
    return any(issubclass(w.category, DeprecationWarning) for w in caught)


def census() -> dict[str, int]:
    """Deprecated aliases per module."""
    counts: dict[str, int] = {}
    infos = [pkgutil.ModuleInfo(None, "fedgrid", True), *pkgutil.walk_packages(fedgrid.__path__, "fedgrid.")]
    for info in infos:
        if info.name.endswith(("_pb2", "_pb2_grpc", "__main__")):
            continue
        loaded: list[ModuleType] = []
        try:
            warned = _warns(lambda name=info.name: loaded.append(importlib.import_module(name)))
        except ImportError as exc:  # an optional extra that is not installed
            print(f"skipped {info.name}: {exc}", file=sys.stderr)
            continue
        module = loaded[0]
        n = int(warned)
        getattr_ = module.__dict__.get("__getattr__")
        names = {"run", "start", "GrpcFleet"}
        for cell in getattr(getattr_, "__closure__", None) or ():
            if isinstance(cell.cell_contents, dict):
                names |= set(cell.cell_contents)
        n += sum(
            _warns(lambda m=module, a=name: getattr(m, a)) for name in names if name not in module.__dict__
        )
        if info.name == "fedgrid.aggregation.fedavg":
            n += len(getattr(module, "LEGACY_SAMPLING_KEYWORDS", ()))
        if n:
            counts[info.name] = n
    return counts


if __name__ == "__main__":
    found = census()
    for name, n in sorted(found.items()):
        print(f"{n:4d} {name}")
    print(f"total {sum(found.values())}")
