"""Durable coordinator state: atomic, checksummed checkpoints and a SQLite run history.

A checkpoint holds everything a restarted coordinator needs to continue exactly: the
round counter, the strategy's state (global model, server-optimizer state), the fleet's
state (run id, client registry) and the per-round metrics so far. It is written to a
temporary file, fsynced, renamed into place and the directory fsynced, so a crash leaves
either the old or the new checkpoint, never half of one. Each file carries an xxh3-64
checksum of its payload; a corrupt newest checkpoint is reported and the previous good
one is used.

The checkpoint is the source of truth: the SQLite history (``history.sqlite``) and the
run directory's ``metrics.jsonl`` are reconciled to it on resume, so each holds every
committed round exactly once.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import xxhash

__all__ = ["Checkpoint", "StateStore", "CorruptCheckpointError"]

log = logging.getLogger(__name__)

MAGIC = b"FGCKPT01"
_NAME = re.compile(r"^ckpt-(\d{8})\.bin$")


class CorruptCheckpointError(Exception):
    """A checkpoint file failed its checksum or could not be decoded."""


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
        self.dir.mkdir(parents=True, exist_ok=True)
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
        """Writes the checkpoint of ``server_round`` atomically, then records its metrics in SQLite."""
        log.info("round %d: writing checkpoint", server_round)
        buf = io.BytesIO()
        torch.save({"round": server_round, "strategy": dict(strategy), "fleet": dict(fleet), "history": list(history)}, buf)
        payload = buf.getvalue()
        path = self.dir / f"ckpt-{server_round:08d}.bin"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
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
            CorruptCheckpointError: bad magic, checksum mismatch or undecodable payload.
        """
        data = path.read_bytes()
        if len(data) < 16 or data[:8] != MAGIC:
            raise CorruptCheckpointError(f"{path.name}: not a fedgrid checkpoint (bad header)")
        payload = data[16:]
        if xxhash.xxh3_64_intdigest(payload) != int.from_bytes(data[8:16], "little"):
            raise CorruptCheckpointError(f"{path.name}: checksum mismatch (file damaged or truncated)")
        try:
            obj = torch.load(io.BytesIO(payload), weights_only=True)
            return Checkpoint(int(obj["round"]), obj["strategy"], obj["fleet"], obj["history"], path)
        except Exception as exc:
            raise CorruptCheckpointError(f"{path.name}: cannot decode: {exc}") from None

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies; corrupt ones are reported and skipped."""
        for _, path in self.checkpoints():
            try:
                return self.read(path)
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
