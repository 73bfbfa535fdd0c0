"""Resolves user code named as ``MODULE:ATTRIBUTE`` (``--app``, ``--model``, ``--strategy``), and
builds a model's seeded initial state."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections import OrderedDict
from typing import Any, Callable

import torch

from fedgrid.errors import ConfigError
from fedgrid.seeding import RNG_LOCK
from fedgrid.types import ModelState

__all__ = [
    "load_object",
    "check_spec",
    "is_factory_spec",
    "is_custom_strategy",
    "initial_state",
    "model_state",
    "MODEL_SCHEMES",
]

#: ``model`` specs ``NAME:...`` that name a built-in model with options (``gpt:layers=4``,
#: ``hf:PATH``; ``fedgrid.simulation.language``), not user code: a module of one of these
#: names cannot be a ``--model`` factory.
MODEL_SCHEMES = ("gpt", "hf")


def check_spec(spec: str, *, key: str) -> tuple[str, str]:
    """Splits ``MODULE:ATTRIBUTE``.

    Raises:
        ConfigError: not of that form (names ``key``).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(key, f"expected MODULE:ATTRIBUTE, got {spec!r}")
    return module_name, attr


def is_factory_spec(model: str) -> bool:
    """Whether the ``model`` key names user code (``MODULE:FACTORY``) rather than a built-in
    model (a name, or ``NAME:OPTIONS`` with ``NAME`` in ``MODEL_SCHEMES``)."""
    return ":" in model and model.partition(":")[0] not in MODEL_SCHEMES


def is_custom_strategy(strategy: str) -> bool:
    """Whether the ``strategy`` key names user code (``MODULE:CLASS``) rather than a built-in
    strategy (a name without a colon)."""
    return ":" in strategy


def load_object(spec: str, *, key: str) -> Callable[..., Any]:
    """Imports ``MODULE`` and returns its callable ``ATTRIBUTE``.

    The current directory is searched last, after ``sys.path``, as ``python -m`` would search
    it (first): the ``fedgrid`` console script does not put it there, and an app made by
    ``fedgrid new NAME`` is run from the folder holding ``NAME/``. Appending it never shadows
    an installed module.

    Raises:
        ConfigError: malformed spec, module not found or failing at import (which module,
            searched where, and the exception), attribute missing or not callable.
    """
    module_name, attr = check_spec(spec, key=key)
    module = _import(module_name, key=key)
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ConfigError(key, f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(key, f"{spec!r} is not callable")
    return obj


def _import(module_name: str, *, key: str) -> Any:
    """Imports ``module_name`` with the current directory on the import path, as
    ``python -m`` has it: ``fedgrid client --app myapp:make`` finds ``./myapp.py`` also when
    run through the ``fedgrid`` script (whose ``sys.path[0]`` is the script's folder).

    Raises:
        ConfigError: the module is not found (the folders searched are named) or raised while
            importing (the exception and the file are named).
    """
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigError(
                key,
                f"no module {module_name!r} in the current directory ({cwd}) or on the import path "
                f"(sys.path, PYTHONPATH): {exc}",
            ) from None
        raise ConfigError(
            key, f"importing {module_name!r} ({_origin(module_name)}) failed: {type(exc).__name__}: {exc}"
        ) from None
    except Exception as exc:  # a SyntaxError, or any error of the module's own code at import
        raise ConfigError(
            key, f"importing {module_name!r} ({_origin(module_name)}) failed: {type(exc).__name__}: {exc}"
        ) from None


def _origin(module_name: str) -> str:
    """Where ``module_name`` was found, for an error message."""
    try:
        spec = importlib.util.find_spec(module_name)
    except Exception:
        spec = None
    return spec.origin if spec is not None and spec.origin else "location unknown"


def initial_state(model_factory: Callable[[], torch.nn.Module], seed: int) -> ModelState:
    """The model initialized from ``seed`` (identical in every process; the global RNG is left as it was)."""
    with RNG_LOCK, torch.random.fork_rng(devices=[]):
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
