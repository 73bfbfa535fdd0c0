"""What ``fedgrid``'s commands share about behaving on a terminal: a parser that suggests the
flag meant, the version, the default run directory, and errors as one line."""

from __future__ import annotations

import argparse
import dataclasses
import time
from importlib import metadata
from typing import Any, NoReturn, Sequence

from fedgrid.config import Config, did_you_mean

__all__ = ["FedgridParser", "package_version", "with_default_out", "error_line"]


class FedgridParser(argparse.ArgumentParser):
    """``argparse`` whose "unrecognized arguments" error names the closest flags of the
    subcommand given (``--roundz``: did you mean ``--rounds``?) instead of leaving the user
    to read the whole ``--help``."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._unrecognized(parsed, extras)
        return parsed

    def _unrecognized(self, parsed: argparse.Namespace, extras: list[str]) -> NoReturn:
        parser: argparse.ArgumentParser = self
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and getattr(parsed, action.dest, None) in action.choices:
                parser = action.choices[getattr(parsed, action.dest)]
        flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
        words = [f"{e}{did_you_mean(e.partition('=')[0], flags, otherwise='')}" if e.startswith("--") else e for e in extras]
        # One line, not the whole usage: the suggestion is the answer, --help has the rest.
        parser.exit(2, f"{parser.prog}: error: unrecognized arguments: {' '.join(words)} (all flags: {parser.prog} --help)\n")


def package_version() -> str:
    """fedgrid's version from the installed package's metadata."""
    try:
        return metadata.version("fedgrid")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def with_default_out(config: Config, command: str) -> Config:
    """``config`` with ``out`` set to ``runs/COMMAND-TIME`` when neither a flag nor the TOML
    file set it (the file's ``out`` wins over this default)."""
    if config.out:
        return config
    return dataclasses.replace(config, out=f"runs/{command}-{time.strftime('%Y%m%d-%H%M%S')}")


def error_line(exc: BaseException) -> str:
    """An error as the one line ``fedgrid: error: ...``: gRPC and library messages can hold
    newlines, which would read as several errors (or a traceback) on a terminal."""
    return "fedgrid: error: " + " ".join(str(exc).split())
