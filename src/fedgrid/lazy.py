"""Namespaces whose names are imported on first access (PEP 562).

``fedgrid`` and its public namespaces (``fedgrid.strategies``, ``fedgrid.aggregators``,
``fedgrid.codecs``) re-export names defined in the layers. Python runs ``fedgrid/__init__.py``
before any ``fedgrid.*`` submodule, so an eager re-export would make ``import fedgrid.config``
load the coordinator, the client runtime and the simulation, with torch and grpc; lazily, each
name costs its import only when it is used.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["exports"]


def exports(
    namespace: str,
    names: dict[str, str],
    *,
    globals_: dict[str, Any],
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module's ``__getattr__`` and ``__dir__`` for lazily imported names.

    Args:
        namespace: the module's name, for error messages.
        names: public name -> the module defining it (``"module"`` or ``"module:attribute"`` when
            the public name differs from the defining one).
        globals_: the module's ``globals()``: a resolved public name is cached there, so later
            accesses skip ``__getattr__``.
    Returns:
        ``(__getattr__, __dir__)``.
    """

    def resolve(where: str, name: str) -> Any:
        module, _, attribute = where.partition(":")
        return getattr(importlib.import_module(module), attribute or name)

    def getattr_(name: str) -> Any:
        if name in names:
            value = resolve(names[name], name)
            globals_[name] = value
            return value
        raise AttributeError(f"module {namespace!r} has no attribute {name!r}")

    def dir_() -> list[str]:
        return sorted(set(globals_) | set(names))

    return getattr_, dir_
