"""Accepted updates spilled to disk, folded later in a canonical order.

Each accepted update of a round is written (atomically) as one safetensors file. The
round's results then hold ``SpilledState`` mappings that read one tensor at a time, so the
coordinator's memory while aggregating stays O(model size) however many clients report,
and folding them sorted by client makes the aggregate bit-identical whatever order the
uploads arrived in. With a state directory the files also survive a crash: a round redone
after a restart takes the updates that had already landed without asking their clients again.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fedgrid.types import ClientInfo, FitRes

__all__ = ["SpilledState", "UpdateSpill"]


class SpilledState(Mapping[str, torch.Tensor]):
    """A read-only model state on disk; each lookup loads one tensor."""

    def __init__(self, path: Path, names: list[str]) -> None:
        self.path = path
        self._names = names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        with safe_open(str(self.path), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def items(self):  # type: ignore[override]
        """Yields (name, tensor) in order, reading through one open file."""
        with safe_open(str(self.path), framework="pt") as f:
            for name in self._names:
                yield name, f.get_tensor(name)


class UpdateSpill:
    """Spill directory for one coordinator.

    Args:
        directory: where round folders go; ``None`` uses a private temporary directory
            (removed by ``close``).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self._temporary = directory is None
        self.dir = Path(tempfile.mkdtemp(prefix="fedgrid-updates-")) if directory is None else Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _round_dir(self, task_id: str) -> Path:
        return self.dir / task_id

    def put(self, *, task_id: str, result: FitRes) -> FitRes:
        """Writes ``result`` for ``task_id``; returns it with its state read back lazily from disk."""
        folder = self._round_dir(task_id)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{result.client.client_id}.safetensors"
        tmp = path.with_suffix(".tmp")
        names = list(result.state)
        meta = {
            "client": json.dumps({**result.client.__dict__, "codecs": list(result.client.codecs)}),
            "num_examples": str(result.num_examples),
            "metrics": json.dumps(dict(result.metrics)),
            "names": json.dumps(names),
        }
        save_file({k: v.contiguous() for k, v in result.state.items()}, str(tmp), metadata=meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return FitRes(result.client, SpilledState(path, names), result.num_examples, result.metrics)  # type: ignore[arg-type]

    def restore(self, *, task_id: str, assigned: Mapping[str, ClientInfo]) -> dict[str, FitRes]:
        """The results of ``task_id`` already on disk, for clients in ``assigned``."""
        folder = self._round_dir(task_id)
        out: dict[str, FitRes] = {}
        if not folder.is_dir():
            return out
        for path in sorted(folder.glob("*.safetensors")):
            cid = path.stem
            if cid not in assigned:
                continue
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata()
                names = json.loads(meta["names"])
                metrics = {k: float(v) for k, v in json.loads(meta["metrics"]).items()}
                out[cid] = FitRes(assigned[cid], SpilledState(path, names), int(meta["num_examples"]), metrics)  # type: ignore[arg-type]
            except Exception:  # a damaged spill file only costs that client a retrain
                path.unlink(missing_ok=True)
        return out

    def discard(self, *, task_id: str, client_id: str) -> None:
        (self._round_dir(task_id) / f"{client_id}.safetensors").unlink(missing_ok=True)

    def clear(self, *, keep: str | None = None) -> None:
        """Removes every round folder but ``keep``."""
        for folder in self.dir.iterdir():
            if folder.is_dir() and folder.name != keep:
                shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        if self._temporary:
            shutil.rmtree(self.dir, ignore_errors=True)
