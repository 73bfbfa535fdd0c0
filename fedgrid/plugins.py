"""Resolves user code named as ``MODULE:ATTRIBUTE`` (``--app``, ``--model``)."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from fedgrid.errors import ConfigError

__all__ = ["load_object", "check_spec"]


def check_spec(spec: str, *, key: str) -> tuple[str, str]:
    """Splits ``MODULE:ATTRIBUTE``.

    Raises:
        ConfigError: not of that form (names ``key``).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(key, f"expected MODULE:ATTRIBUTE, got {spec!r}")
    return module_name, attr


def load_object(spec: str, *, key: str) -> Callable[..., Any]:
    """Imports ``MODULE`` and returns its callable ``ATTRIBUTE``.

    Raises:
        ConfigError: malformed spec, module not importable, attribute missing or not callable.
    """
    module_name, attr = check_spec(spec, key=key)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(key, f"cannot import {module_name!r}: {exc}") from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ConfigError(key, f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(key, f"{spec!r} is not callable")
    return obj
