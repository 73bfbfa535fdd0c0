"""The run directory: ``metrics.jsonl`` (one JSON object per round), ``model.safetensors``
(the final global model) and ``config.toml`` (the resolved configuration); ``strict_json``, the
JSON every reader parses (no ``NaN`` or ``Infinity``, which ``json.dumps`` writes by default)."""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fedgrid.trackers import Trackers, build_trackers
from fedgrid.types import ModelState, RoundMetrics

__all__ = ["RunWriter", "load_model", "read_metrics", "strict_json", "to_toml", "ORDER_KEY"]

#: safetensors metadata key holding the model's tensor names in its own order (JSON list).
ORDER_KEY = "fedgrid.order"


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def strict_json(value: object, **kwargs: object) -> str:
    """``json.dumps(value, **kwargs)`` as strict JSON: a float that is not finite (a sum of
    figures that overflowed, a mean of nothing) is written ``null``, never ``NaN`` or
    ``Infinity``, which strict parsers (a browser's ``JSON.parse``) refuse."""
    return json.dumps(_finite(value), allow_nan=False, **kwargs)  # type: ignore[arg-type]


def _toml_string(value: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped, the rest as is."""
    escaped = "".join(
        f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else "\\" + ch if ch in '"\\' else ch
        for ch in value
    )
    return f'"{escaped}"'


def to_toml(values: Mapping[str, object]) -> str:
    """Flat TOML for scalar values (``None`` is left out: TOML has no null)."""
    lines = []
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = _toml_string(str(value))
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


class RunWriter:
    """Writes one run directory.

    Args:
        out: the directory; created if missing.
        config: the resolved configuration, written at once as ``config.toml``.
        environment: what the run ran on (``fedgrid.determinism.environment``), written
            as the file's ``[environment]`` table; ``load_config`` reads the file back.

    The experiment trackers that ``config["tracker"]`` names (``fedgrid.trackers``) get
    every row this writer appends to ``metrics.jsonl``, after the file has it; ``close``
    ends them.

    Raises:
        ConfigError: a tracker's package is missing (before the directory is made).
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        config: Mapping[str, object],
        *,
        environment: Mapping[str, object] | None = None,
    ) -> None:
        self.dir = Path(out)
        self.trackers: Trackers = build_trackers(str(config.get("tracker") or ""), self.dir, config)
        self.dir.mkdir(parents=True, exist_ok=True)
        text = to_toml(config)
        if environment:
            text += "\n[environment]\n" + to_toml(environment)
        self._atomic_write("config.toml", text.encode())
        self.metrics_path = self.dir / "metrics.jsonl"
        self.metrics_path.touch()

    def reset_metrics(self, rows: Sequence[Mapping[str, object]]) -> None:
        """Makes ``metrics.jsonl`` hold exactly ``rows`` (a fresh run: none; a resumed one:
        the committed rounds), replacing the file atomically."""
        self._atomic_write("metrics.jsonl", "".join(strict_json(dict(r)) + "\n" for r in rows).encode())
        self.trackers.resume(rows)

    def write_round(self, metrics: RoundMetrics, *, track: bool = True) -> None:
        """Appends the round to ``metrics.jsonl``, then hands it to the trackers; ``track=False``:
        not yet, its evaluation is still running (``update_round`` will).

        The line is in the kernel's page cache when this returns, which outlives a crash of the
        process; ``close`` fsyncs the file. No fsync per round: it is on the round's path (the
        next round opens after the commit), 5 ms median and 12 ms at p90 on these machines'
        disks, a third of a tiny model's sync; a machine crash is what a state directory's
        checkpoint covers (a resumed run rewrites this file from it: ``reset_metrics``)."""
        row = metrics.to_json()
        with open(self.metrics_path, "a") as f:
            f.write(strict_json(row) + "\n")
        if track:
            self.trackers.log_round(row)

    def update_round(self, metrics: RoundMetrics, rows: Sequence[Mapping[str, object]]) -> None:
        """A committed round's row gained figures (its server-side evaluation, which landed after
        the round committed): ``metrics.jsonl`` is replaced atomically by ``rows`` (each round's
        row, ``metrics``' among them), then the trackers get ``metrics``' row: once per round, as
        its commit left it to them (``write_round(track=False)``)."""
        self._atomic_write("metrics.jsonl", "".join(strict_json(dict(r)) + "\n" for r in rows).encode())
        self.trackers.log_round(metrics.to_json())

    def close(self) -> None:
        """Makes ``metrics.jsonl`` durable (``write_round`` does not fsync) and ends the trackers
        (flushes TensorBoard, ends the MLflow run)."""
        with open(self.metrics_path, "a") as f:
            os.fsync(f.fileno())
        self.trackers.close()

    def write_model(self, state: ModelState) -> Path:
        path = self.dir / "model.safetensors"
        tmp = path.with_suffix(".tmp")
        # safetensors stores tensors sorted by name; the model's own order (which e.g. block
        # and fragment partitions follow) travels in the metadata.
        save_file(
            {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()},
            str(tmp),
            metadata={ORDER_KEY: json.dumps(list(state))},
        )
        os.replace(tmp, path)
        return path

    def _atomic_write(self, name: str, data: bytes) -> None:
        tmp = self.dir / (name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / name)


def load_model(path: str | os.PathLike[str]) -> "OrderedDict[str, torch.Tensor]":
    """Loads a ``model.safetensors`` (a run's, or any), in the model's own tensor order when
    the file records it, else in the file's (sorted) order."""
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    try:
        order = json.loads(metadata[ORDER_KEY])
    except (KeyError, ValueError):
        return OrderedDict(tensors)
    if not isinstance(order, list) or sorted(order) != sorted(tensors):
        return OrderedDict(tensors)
    return OrderedDict((name, tensors[name]) for name in order)


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, object]]:
    """Parses a run's ``metrics.jsonl``."""
    text = (Path(run_dir) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]
