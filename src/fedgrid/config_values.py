"""How a value becomes a config key's type, one way for TOML files and Python overrides
(``coerce``: the value must already be of the type), and the one parser of command-line text
(``parse_text``: ``--rounds 5`` is the integer 5). ``fedgrid.config`` applies them per key."""

from __future__ import annotations

import dataclasses
from typing import Any

from fedgrid.errors import ConfigError

__all__ = ["coerce", "parse_text", "key"]


def key(help_text: str, default: Any) -> Any:
    """A ``Config`` key: a dataclass field with its default and its ``--help`` text. The keys of
    one area may live in a frozen dataclass of their own module that ``Config`` inherits
    (``fedgrid.config``), so that the areas' keys are not all in one file."""
    return dataclasses.field(default=default, metadata={"help": help_text})


_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _describe(value: Any) -> str:
    """``value`` as an error names it: its TOML kind, then the value."""
    kind = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}.get(type(value))
    return f"{kind or type(value).__name__} {value!r}"


def coerce(key: str, value: Any, kind: type) -> Any:
    """``value`` checked against the key's type, one way for TOML files and Python overrides:
    an ``int`` key takes only integers (not ``"5"``, not ``5.0``), a ``float`` key integers or
    floats, a ``bool`` key only booleans, a ``str`` key only strings. Command-line text is
    parsed first (``parse_text``).

    Raises:
        ConfigError: any other value, naming the key, the type expected and the value given.
    """
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # ``lr = 1`` in TOML is an integer: exactly a float
    if type(value) is kind:
        return value
    hint = ""
    if isinstance(value, str) and kind is not str:
        try:
            parse_text(key, value, kind)
            hint = f" (a string: without the quotes, {key} = {value})"
        except ConfigError:
            pass
    elif kind is int and isinstance(value, float):
        hint = " (a whole number, without a decimal point)"
    raise ConfigError(key, f"expected {kind.__name__}, got {_describe(value)}{hint}")


def parse_text(key: str, text: str, kind: type) -> Any:
    """A flag's ``text`` as ``kind`` (``bool``: true/false, 1/0, yes/no, any case).

    Raises:
        ConfigError: text that is not of the type, naming the key.
    """
    try:
        if kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError(text)
            return text.lower() in _TRUE
        return kind(text)
    except ValueError:
        raise ConfigError(key, f"expected {kind.__name__}, got {text!r}") from None
