"""Durable coordinator state: atomic, checksummed checkpoints and a SQLite run history.

A checkpoint holds everything a restarted coordinator needs to continue exactly: the
round counter, the strategy's state (global model, server-optimizer state), the fleet's
state (run id, client registry) and the per-round metrics so far. It is written to a
temporary file, fsynced, renamed into place and the directory fsynced, so a crash leaves
either the old or the new checkpoint, never half of one. Each file carries an xxh3-64
checksum of its payload; a corrupt newest checkpoint is reported and the previous good
one is used.

Format (``FGCKPT02``): ``MAGIC``, the checksum, then the payload: an 8-byte little-endian
length, a JSON document holding the structure and every non-tensor value, and a
safetensors blob holding the tensors. No pickle is written or read: a checkpoint is data,
so a file planted in the state directory cannot run code in the coordinator. In the JSON,
every object is a tag (``{"dict": [[key, value], ...]}``, ``{"tensor": name}``,
``{"tuple": [...]}``, ``{"float": "nan"}``, ``{"numpy": dtype, "value": v}``,
``{"bytes": base64}``), so dicts keep their key types and order, tuples stay tuples and
OrderedDicts stay OrderedDicts; tensors are keyed by their path (``strategy.global_state.w``).
Anything else is refused when the checkpoint is written (naming its path), not found
missing at the restart. Files are created mode 0600: they hold the run's model and the
clients' session-token hashes. Checkpoints of the previous, pickle-based format
(``FGCKPT01``) are refused with ``CheckpointFormatError``, which also stops the fallback:
resuming an older checkpoint of the new format past a newer old-format one would silently
lose rounds; move such files away to start afresh.

The checkpoint is the source of truth: the SQLite history (``history.sqlite``) and the
run directory's ``metrics.jsonl`` are reconciled to it on resume, so each holds every
committed round exactly once.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import re
import sqlite3
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import safetensors.torch
import torch
import xxhash

__all__ = [
    "Checkpoint",
    "StateStore",
    "CorruptCheckpointError",
    "CheckpointFormatError",
    "encode_state",
    "decode_state",
]

log = logging.getLogger(__name__)

MAGIC = b"FGCKPT02"
#: Magic numbers of earlier formats, refused by name.
OLD_FORMATS = {b"FGCKPT01": "FGCKPT01 (torch.save pickle, fedgrid before safetensors checkpoints)"}
_NAME = re.compile(r"^ckpt-(\d{8})\.bin$")


class CorruptCheckpointError(Exception):
    """A checkpoint file failed its checksum or could not be decoded."""


class CheckpointFormatError(CorruptCheckpointError):
    """A checkpoint of an earlier format that this version does not read."""


def encode_state(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-ready structure, tensors by path) of a checkpoint's content (see the module docstring).

    Raises:
        TypeError: a value of a type a checkpoint cannot hold (the message names its path).
    """
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()  # storage addresses of the tensors kept

    def enc(value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"float": repr(value)}
        if isinstance(value, torch.Tensor):
            key = path if path not in tensors else f"{path}#{len(tensors)}"
            t = value.detach().cpu().contiguous()
            if t.numel():  # safetensors refuses tensors sharing memory: copy a second view
                if t.untyped_storage().data_ptr() in storages:
                    t = t.clone()
                storages.add(t.untyped_storage().data_ptr())
            tensors[key] = t
            return {"tensor": key}
        if isinstance(value, np.generic):
            return {"numpy": value.dtype.str, "value": enc(value.item(), path)}
        if isinstance(value, bytes):
            return {"bytes": base64.b64encode(value).decode("ascii")}
        if isinstance(value, tuple):
            return {"tuple": [enc(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [enc(v, f"{path}.{i}") for i, v in enumerate(value)]
        if isinstance(value, dict):
            items = [[enc(k, f"{path}.<key>"), enc(v, f"{path}.{k}")] for k, v in value.items()]
            return {"odict" if isinstance(value, OrderedDict) else "dict": items}
        raise TypeError(
            f"checkpoint value at {path or '<root>'}: {type(value).__name__} cannot be stored (no pickles)"
        )

    return enc(obj, ""), tensors


def decode_state(doc: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of ``encode_state``.

    Raises:
        ValueError: an unknown tag or a missing tensor.
    """
    if doc is None or isinstance(doc, (bool, int, float, str)):
        return doc
    if isinstance(doc, list):
        return [decode_state(v, tensors) for v in doc]
    if not isinstance(doc, dict) or len(doc) not in (1, 2):
        raise ValueError(f"malformed checkpoint document near {str(doc)[:80]}")
    if "tensor" in doc:
        return tensors[doc["tensor"]]
    if "dict" in doc or "odict" in doc:
        pairs = doc["odict"] if "odict" in doc else doc["dict"]
        items = [(decode_state(k, tensors), decode_state(v, tensors)) for k, v in pairs]
        return OrderedDict(items) if "odict" in doc else dict(items)
    if "tuple" in doc:
        return tuple(decode_state(v, tensors) for v in doc["tuple"])
    if "float" in doc:
        return float(doc["float"])
    if "numpy" in doc:
        return np.dtype(doc["numpy"]).type(decode_state(doc["value"], tensors))
    if "bytes" in doc:
        return base64.b64decode(doc["bytes"])
    raise ValueError(f"unknown checkpoint tag {sorted(doc)}")


def _payload(content: Mapping[str, Any]) -> bytes:
    doc, tensors = encode_state(dict(content))
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return len(text).to_bytes(8, "little") + text + safetensors.torch.save(tensors)


def _content(payload: bytes) -> Any:
    n = int.from_bytes(payload[:8], "little")
    if len(payload) < 8 or n > len(payload) - 8:
        raise ValueError("payload shorter than its JSON document")
    doc = json.loads(payload[8 : 8 + n])
    tensors = safetensors.torch.load(payload[8 + n :])
    return decode_state(doc, tensors)


@dataclass(frozen=True)
class Checkpoint:
    """One committed round."""

    round: int
    strategy: Mapping[str, Any]
    fleet: Mapping[str, Any]
    history: Sequence[Mapping[str, Any]]
    path: Path


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StateStore:
    """Checkpoints and history in one directory.

    Args:
        directory: created if missing.
        keep: how many checkpoints to keep (at least 2, so a corrupt newest has a fallback).
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3) -> None:
        if keep < 2:
            raise ValueError(f"keep must be at least 2, got {keep}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.keep = keep
        self.db_path = self.dir / "history.sqlite"
        with self._db() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS rounds (round INTEGER PRIMARY KEY, metrics TEXT NOT NULL, committed_at REAL NOT NULL)"
            )

    def _db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.db_path, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        return db

    # -- checkpoints -------------------------------------------------------------------------
    def checkpoints(self) -> list[tuple[int, Path]]:
        """(round, path) of every checkpoint file, newest first."""
        found = []
        for path in self.dir.iterdir():
            m = _NAME.match(path.name)
            if m:
                found.append((int(m.group(1)), path))
        return sorted(found, reverse=True)

    def save(
        self,
        *,
        server_round: int,
        strategy: Mapping[str, Any],
        fleet: Mapping[str, Any],
        history: Sequence[Mapping[str, Any]],
    ) -> Path:
        """Writes the checkpoint of ``server_round`` atomically (mode 0600), then records its
        metrics in SQLite.

        Raises:
            TypeError: the state holds a value a checkpoint cannot store (nothing written).
        """
        log.info("round %d: writing checkpoint", server_round)
        payload = _payload(
            {
                "round": server_round,
                "strategy": dict(strategy),
                "fleet": dict(fleet),
                "history": list(history),
            }
        )
        path = self.dir / f"ckpt-{server_round:08d}.bin"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # a leftover .tmp keeps its mode through O_CREAT
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC)
            f.write(xxhash.xxh3_64_intdigest(payload).to_bytes(8, "little"))
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.dir)
        self.sync_history(history)
        for _, old in self.checkpoints()[self.keep :]:
            old.unlink(missing_ok=True)
        return path

    @staticmethod
    def read(path: Path) -> Checkpoint:
        """Reads and verifies one checkpoint file.

        Raises:
            CheckpointFormatError: a checkpoint of an earlier format (named).
            CorruptCheckpointError: bad magic, checksum mismatch or undecodable payload.
        """
        data = path.read_bytes()
        if data[:8] in OLD_FORMATS:
            raise CheckpointFormatError(
                f"{path.name}: checkpoint format {OLD_FORMATS[data[:8]]} is no longer read (this version writes "
                f"{MAGIC.decode()}: safetensors and JSON); move it away to start the run afresh"
            )
        if len(data) < 16 or data[:8] != MAGIC:
            raise CorruptCheckpointError(f"{path.name}: not a fedgrid checkpoint (bad header)")
        payload = data[16:]
        if xxhash.xxh3_64_intdigest(payload) != int.from_bytes(data[8:16], "little"):
            raise CorruptCheckpointError(f"{path.name}: checksum mismatch (file damaged or truncated)")
        try:
            obj = _content(payload)
            return Checkpoint(int(obj["round"]), obj["strategy"], obj["fleet"], obj["history"], path)
        except Exception as exc:
            raise CorruptCheckpointError(f"{path.name}: cannot decode: {exc}") from None

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies; corrupt ones are reported and skipped.

        Raises:
            CheckpointFormatError: a checkpoint of an earlier format comes first (see the module docstring).
        """
        for _, path in self.checkpoints():
            try:
                return self.read(path)
            except CheckpointFormatError:
                raise
            except CorruptCheckpointError as exc:
                log.error("corrupt checkpoint, falling back to the previous one: %s", exc)
        return None

    # -- history -----------------------------------------------------------------------------
    def sync_history(self, history: Sequence[Mapping[str, Any]]) -> None:
        """Makes the SQLite history hold exactly ``history``'s rounds (one row each)."""
        rounds = [int(m["round"]) for m in history]
        with self._db() as db:
            db.execute("DELETE FROM rounds WHERE round > ?", (max(rounds, default=0),))
            db.executemany(
                "INSERT OR IGNORE INTO rounds (round, metrics, committed_at) VALUES (?, ?, ?)",
                [(int(m["round"]), json.dumps(dict(m)), time.time()) for m in history],
            )

    def history(self) -> list[dict[str, Any]]:
        """The committed rounds' metrics, in round order."""
        with self._db() as db:
            rows = db.execute("SELECT metrics FROM rounds ORDER BY round").fetchall()
        return [json.loads(r[0]) for r in rows]
