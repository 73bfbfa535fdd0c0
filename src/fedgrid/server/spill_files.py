"""One accepted update as a safetensors file: ``SpillWriter`` writes it tensor by tensor as
the tensors complete, ``SpilledState`` reads it back one tensor at a time. The spill that
decides when updates are written (``fedgrid.server.spill``) builds on these.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from fedgrid.types import TensorSpec

__all__ = ["SAFETENSORS_DTYPES", "SpilledState", "SpillWriter"]

#: safetensors' dtype names (its file format's, stable across versions).
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",
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

    def __init__(
        self,
        path: Path,
        specs: Mapping[str, TensorSpec],
        metadata: Mapping[str, str],
        *,
        durable: bool = True,
        sync_later: "Callable[[Path], None] | None" = None,
    ) -> None:
        self.path = path
        self.durable = durable
        self._sync_later = sync_later  # durable: fsync after the rename, off the reply's path
        self._tmp = path.with_suffix(".part")
        self._names = list(specs)
        header: dict[str, object] = {"__metadata__": dict(metadata)}
        self._offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, spec in specs.items():
            size = spec.nbytes
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + size],
            }
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

    def sync(self) -> None:
        """Flushes (and, when durable, fsyncs) the complete file under its temporary name."""
        missing = [n for n in self._names if n not in self._written]
        if missing:
            raise ValueError(f"spill of {self.path.name} lacks tensors {missing[:3]}")
        self._file.flush()
        if self.durable and self._sync_later is None:
            os.fsync(self._file.fileno())
        self._file.close()

    def rename(self) -> SpilledState:
        """Puts the synced file in place: from here on a restart restores it."""
        os.replace(self._tmp, self.path)
        if self.durable and self._sync_later is not None:
            self._sync_later(self.path)
        return SpilledState(self.path, self._names)

    def commit(self) -> SpilledState:
        self.sync()
        return self.rename()

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)
