"""Resolves user code named as ``MODULE:ATTRIBUTE`` (``--app``, ``--model``), and builds a
model's seeded initial state."""

from __future__ import annotations

import importlib
import os
import sys
from collections import OrderedDict
from typing import Any, Callable

import torch

from fedgrid.errors import ConfigError
from fedgrid.types import ModelState

__all__ = ["load_object", "check_spec", "initial_state", "model_state"]


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

    The current directory is searched last, after ``sys.path``, as ``python -m`` would search
    it (first): the ``fedgrid`` console script does not put it there, and an app made by
    ``fedgrid new NAME`` is run from the folder holding ``NAME/``. Appending it never shadows
    an installed module.

    Raises:
        ConfigError: malformed spec, module not importable, attribute missing or not callable.
    """
    module_name, attr = check_spec(spec, key=key)
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
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


def initial_state(model_factory: Callable[[], torch.nn.Module], seed: int) -> ModelState:
    """The model initialized from ``seed`` (identical in every process; the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_factory()
    return OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())


def model_state(spec: str, *, seed: int, key: str = "model") -> ModelState:
    """The seeded initial state of the ``nn.Module`` that ``MODULE:FACTORY`` returns.

    Raises:
        ConfigError: the spec cannot be loaded, or building the model failed (names ``key``).
    """
    factory = load_object(spec, key=key)
    try:
        state = initial_state(factory, seed)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(key, f"building the model failed: {type(exc).__name__}: {exc}") from None
    if not state:
        raise ConfigError(key, f"{spec!r} built a model without parameters or buffers")
    return state
