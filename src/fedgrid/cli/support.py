"""What ``fedgrid``'s commands share: a parser that suggests the flag meant, the version, the
default run directory, errors as one line, and the config keys each command takes as flags."""

from __future__ import annotations

import argparse
import dataclasses
import time
from importlib import metadata
from typing import TYPE_CHECKING, Any, NoReturn, Sequence

if TYPE_CHECKING:
    from fedgrid.config import Config

__all__ = [
    "FedgridParser",
    "package_version",
    "with_default_out",
    "error_line",
    "add_config_flags",
    "config_from",
    "SIMULATE_KEYS",
    "COORDINATOR_KEYS",
    "REGION_KEYS",
    "CLIENT_OPTION_KEYS",
    "CLIENT_CONFIG_KEYS",
]

# Keys each subcommand exposes as flags; every key is also accepted through --config. They come
# from fedgrid.config, which imports torch: computed on first use (``__getattr__``), so that the
# commands that need no config (``fedgrid certs``, ``health``, ``status``) import this module for
# their parser without it.
SIMULATE_KEYS: list[str]
COORDINATOR_KEYS: list[str]
#: ``fedgrid region``: a coordinator's keys for its own clients (not the global run's length, model or
#: enrollment and status servers, which the global coordinator has), and its upstream link.
REGION_KEYS: list[str]
#: What ``fedgrid client --config FILE`` takes from the file (flags override it); the file's
#: other keys (a TOML shared with the coordinator) are checked and left alone.
CLIENT_CONFIG_KEYS: list[str]

# The built-in client factory's options (fedgrid.simulation.tasks.CLIENT_KEYS) as `fedgrid
# client` flags, so a deployed client trains like its simulated twin; --data-partition is the spec.
CLIENT_OPTION_KEYS = [
    "dataset",
    "data_dir",
    "text_column",
    "label_column",
    "model",
    "batch_size",
    "optimizer",
    "lr",
    "momentum",
    "weight_decay",
    "precision",
    "peft",
    "peft_rank",
    "lora_aggregation",
    "grad_accum",
    "grad_checkpointing",
]


def _key_lists() -> dict[str, list[str]]:
    from fedgrid.config import (
        CLIENT_ONLY_KEYS,
        CLIENT_SIDE_KEYS,
        COORDINATOR_ONLY_KEYS,
        PRIVACY_KEYS,
        QUORUM_KEYS,
        REGION_ONLY_KEYS,
        SIMULATION_ONLY_KEYS,
        config_keys,
    )

    simulate = [
        k for k in config_keys() if k not in COORDINATOR_ONLY_KEYS | CLIENT_ONLY_KEYS | REGION_ONLY_KEYS
    ]
    coordinator = [
        k
        for k in config_keys()
        if k not in SIMULATION_ONLY_KEYS | CLIENT_ONLY_KEYS | REGION_ONLY_KEYS | CLIENT_SIDE_KEYS
    ]
    region = [
        k
        for k in coordinator
        if k
        not in (
            # model stays: a --peft run's region hashes its frozen base (fedgrid.cli.region.serve)
            *("rounds", "initial_model", "enroll_listen", "enroll_dir", "http", "http_token_file"),
            "http_linger_s",
            "eval_every",
            "eval_batches",  # a region evaluates nothing of its own: the global coordinator does
            *QUORUM_KEYS,
            *PRIVACY_KEYS,
        )
    ] + ["regional_rounds", *sorted(REGION_ONLY_KEYS)]
    client_config = [
        *CLIENT_OPTION_KEYS,
        "quiet",
        "partition",
        "threads",
        "ca",
        "cert",
        "key",
        *sorted(CLIENT_ONLY_KEYS),
    ]
    return {
        "SIMULATE_KEYS": simulate,
        "COORDINATOR_KEYS": coordinator,
        "REGION_KEYS": region,
        "CLIENT_CONFIG_KEYS": client_config,
    }


def __getattr__(name: str) -> list[str]:
    """The key lists above, computed (and cached in the module) on first use."""
    if name not in ("SIMULATE_KEYS", "COORDINATOR_KEYS", "REGION_KEYS", "CLIENT_CONFIG_KEYS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals().update(_key_lists())
    return globals()[name]


class FedgridParser(argparse.ArgumentParser):
    """``argparse`` whose "unrecognized arguments" error names the closest flags of the
    subcommand given (``--roundz``: did you mean ``--rounds``?) instead of leaving the user
    to read the whole ``--help``. A flag is never abbreviated (``allow_abbrev=False``): ``--local 1``
    is that error, not ``--local-epochs 1``, and a prefix that fits several flags is too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._unrecognized(parsed, extras)
        return parsed

    def _unrecognized(self, parsed: argparse.Namespace, extras: list[str]) -> NoReturn:
        parser: argparse.ArgumentParser = self
        for action in self._actions:
            if (
                isinstance(action, argparse._SubParsersAction)
                and getattr(parsed, action.dest, None) in action.choices
            ):
                parser = action.choices[getattr(parsed, action.dest)]
        # Compared without their "--": every flag shares it, which made --round "close" to --out.
        flags = [s[2:] for a in parser._actions for s in a.option_strings if s.startswith("--")]
        words = [
            f"{e}{_closest_flags(e.partition('=')[0][2:], flags)}" if e.startswith("--") else e
            for e in extras
        ]
        # One line, not the whole usage: the suggestion is the answer, --help has the rest.
        parser.exit(
            2,
            f"{parser.prog}: error: unrecognized arguments: {' '.join(words)} (all flags: {parser.prog} --help)\n",
        )


def _closest_flags(name: str, flags: list[str]) -> str:
    """``" (did you mean '--x'?)"`` for the flags (names without ``--``) that ``name`` begins, or
    else the closest to it (``difflib``), or ""."""
    import difflib

    close = [f for f in flags if f.startswith(name)][:3] or difflib.get_close_matches(
        name, flags, n=3, cutoff=0.6
    )
    return " (did you mean " + " or ".join(repr("--" + c) for c in close) + "?)" if close else ""


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


def add_config_flags(
    parser: argparse.ArgumentParser, keys: Sequence[str], *, with_config: bool = True
) -> None:
    if with_config:
        parser.add_argument("--config", metavar="FILE", help="TOML file; flags override its keys")
    from fedgrid.config import config_keys, key_type

    fields = config_keys()
    for key in keys:
        f = fields[key]
        kind, optional = key_type(f)
        default = "the strategy's" if optional and f.default is None else repr(f.default)
        # A bare boolean flag means true (--insecure); --insecure false still parses.
        flag: dict[str, Any] = {"nargs": "?", "const": "true"} if kind is bool else {}
        parser.add_argument(
            "--" + key.replace("_", "-"),
            dest=key,
            metavar=kind.__name__.upper(),
            default=None,
            help=f"{f.metadata['help']} (default: {default})",
            **flag,
        )


def config_from(args: argparse.Namespace, keys: Sequence[str]) -> Config:
    """The command's config: ``--config``'s file, then the flags given (their text parsed as
    the keys' types: ``parse_flags``)."""
    from fedgrid.config import load_config, parse_flags

    overrides = parse_flags({k: getattr(args, k, None) for k in keys})
    return with_default_out(load_config(args.config, overrides), args.command)
