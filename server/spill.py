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

from fedgrid.types import ClientInfo, FitRes, TensorSpec

__all__ = ["SpilledState", "UpdateSpill", "SpillWriter"]

#: safetensors' dtype names (its file format's, stable across versions).
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.complex64: "C64",
}


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


class SpillWriter:
    """Writes one update into its safetensors file tensor by tensor, as tensors complete,
    so an upload in progress holds one tensor in memory, not the whole update.

    The header (names, dtypes, shapes, offsets, metadata) is written first from the
    expected specs; ``write`` puts each tensor's bytes at its offset; ``commit`` fsyncs and
    renames the file into place.
    """

    def __init__(self, path: Path, specs: Mapping[str, TensorSpec], metadata: Mapping[str, str], *, durable: bool = True) -> None:
        self.path = path
        self.durable = durable
        self._tmp = path.with_suffix(".part")
        self._names = list(specs)
        header: dict[str, object] = {"__metadata__": dict(metadata)}
        self._offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, spec in specs.items():
            size = _numel(spec.shape) * torch.empty((), dtype=spec.dtype).element_size()
            header[name] = {"dtype": SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape), "data_offsets": [offset, offset + size]}
            self._offsets[name] = (offset, offset + size)
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._data_start = 8 + len(text)
        self._file = open(self._tmp, "wb")
        self._file.write(len(text).to_bytes(8, "little") + text)
        self._file.truncate(self._data_start + offset)
        self._written: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        begin, end = self._offsets[name]
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        raw = memoryview(data.view(torch.uint8).numpy().data) if data.numel() else memoryview(b"")
        if len(raw) != end - begin:
            raise ValueError(f"tensor '{name}': {len(raw)} bytes, the file has room for {end - begin}")
        self._file.seek(self._data_start + begin)
        self._file.write(raw)
        self._written.add(name)

    def commit(self) -> SpilledState:
        missing = [n for n in self._names if n not in self._written]
        if missing:
            raise ValueError(f"spill of {self.path.name} lacks tensors {missing[:3]}")
        self._file.flush()
        if self.durable:
            os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)
        return SpilledState(self.path, self._names)

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class UpdateSpill:
    """Spill directory for one coordinator.

    Args:
        directory: where round folders go; ``None`` uses a private temporary directory
            (removed by ``close``), whose files are not fsynced: nothing reads them after a
            crash. Under a state directory they are, so a restart can trust them.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self._temporary = directory is None
        self.durable = not self._temporary
        self.dir = Path(tempfile.mkdtemp(prefix="fedgrid-updates-")) if directory is None else Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _round_dir(self, task_id: str) -> Path:
        return self.dir / task_id

    def writer(self, *, task_id: str, client: ClientInfo, specs: Mapping[str, TensorSpec], num_examples: int,
               metrics: Mapping[str, float]) -> SpillWriter | None:
        """A streaming writer for one update, or ``None`` when a dtype cannot be spilled
        that way (then ``put`` the finished update)."""
        if any(spec.dtype not in SAFETENSORS_DTYPES for spec in specs.values()):
            return None
        folder = self._round_dir(task_id)
        folder.mkdir(parents=True, exist_ok=True)
        return SpillWriter(
            folder / f"{client.client_id}.safetensors", specs, self._metadata(client, list(specs), num_examples, metrics), durable=self.durable
        )

    @staticmethod
    def _metadata(client: ClientInfo, names: list[str], num_examples: int, metrics: Mapping[str, float]) -> dict[str, str]:
        return {
            "client": json.dumps({**client.__dict__, "codecs": list(client.codecs)}),
            "num_examples": str(num_examples),
            "metrics": json.dumps(dict(metrics)),
            "names": json.dumps(names),
        }

    def put(self, *, task_id: str, result: FitRes) -> FitRes:
        """Writes ``result`` for ``task_id``; returns it with its state read back lazily from disk."""
        folder = self._round_dir(task_id)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{result.client.client_id}.safetensors"
        tmp = path.with_suffix(".tmp")
        names = list(result.state)
        meta = self._metadata(result.client, names, result.num_examples, result.metrics)
        save_file({k: v.contiguous() for k, v in result.state.items()}, str(tmp), metadata=meta)
        if self.durable:
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
