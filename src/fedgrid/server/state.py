"""Durable coordinator state: atomic, checksummed checkpoints and a SQLite run history.

A checkpoint holds everything a restarted coordinator needs to continue exactly: the
round counter, the strategy's state (global model, server-optimizer state), the fleet's
state (run id, client membership) and the per-round metrics so far. It is written to a
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

The checkpoint is the source of truth: the SQLite history (``history.sqlite``, the
journal) and the run directory's ``metrics.jsonl`` are reconciled to it on resume, so each
holds every committed round exactly once.

Recovery refuses rather than guesses (``RecoveryError``, naming the files): a checkpoint's
round must be the one its file name says and the last of the history inside it; the journal,
written just after each checkpoint, may lag it by one round but may not record a round past
every checkpoint file, nor another version of the checkpoint's round; and a state directory
whose checkpoints are all unreadable (or whose journal records rounds with no checkpoint
left) does not start a new run over itself. ``set_aside`` (``--fresh``) moves the old files
to ``discarded-TIMESTAMP/`` for a deliberate new run.

With a key (``--state-key FILE``, kept outside the state directory) checkpoints are
``FGCKPT2H``: the magic, an HMAC-SHA256 tag of the payload, the payload; only those, with a
valid tag, are read, so a process that can write the state directory but not read the key
cannot plant a model. (Spilled updates under ``updates/`` are not authenticated: a redone
round may take them, each still checked and bounded like any upload.)

A write the disk refuses (no space, an I/O error; ``server/disk.py``) raises
``StorageError`` naming the path and the free space; the temporary file is removed and the
last good checkpoint stays.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import mmap
import os
import re
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import xxhash

from fedgrid.errors import RecoveryError
from fedgrid.server.disk import is_storage_failure, storage_error
from fedgrid.server.state_codec import content_of, decode_state, encode_state, payload_chunks

__all__ = [
    "Checkpoint",
    "StateStore",
    "CorruptCheckpointError",
    "CheckpointFormatError",
    "encode_state",
    "decode_state",
    "checkpoint_name",
    "read_state_key",
]

log = logging.getLogger(__name__)

MAGIC = b"FGCKPT02"
#: An authenticated checkpoint (``--state-key``): the magic, an HMAC-SHA256 tag, the payload.
MAGIC_AUTH = b"FGCKPT2H"
#: The shortest state key accepted (HMAC-SHA256 keys shorter than this are guessable).
MIN_KEY_BYTES = 32
#: Magic numbers of earlier formats, refused by name.
OLD_FORMATS = {b"FGCKPT01": "FGCKPT01 (torch.save pickle, fedgrid before safetensors checkpoints)"}
_NAME = re.compile(r"^ckpt-(\d{8})\.bin$")


class CorruptCheckpointError(Exception):
    """A checkpoint file failed its checksum or could not be decoded."""


class CheckpointFormatError(CorruptCheckpointError):
    """A checkpoint of an earlier format that this version does not read."""


def checkpoint_name(server_round: int) -> str:
    """The file name of ``server_round``'s checkpoint."""
    return f"ckpt-{server_round:08d}.bin"


def read_state_key(path: str | os.PathLike[str]) -> bytes:
    """The checkpoint key in file ``path`` (``--state-key``): its bytes, at least ``MIN_KEY_BYTES``.

    Raises:
        ValueError: an unreadable or short file (named).
    """
    try:
        key = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the state key {path}: {exc.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"the state key {path} holds {len(key)} bytes, at least {MIN_KEY_BYTES} are needed "
            "(e.g. head -c 32 /dev/urandom > KEYFILE)"
        )
    return key


def _verified(name: str, data: bytes | memoryview, key: bytes | None) -> bytes | memoryview:
    """The payload of checkpoint ``data`` once its checksum (or, with ``key``, its HMAC tag) holds.

    Raises:
        CorruptCheckpointError: naming ``name`` and what failed.
    """
    if key is not None:
        if data[:8] == MAGIC:
            raise CorruptCheckpointError(f"{name}: not authenticated (written without a state key)")
        if len(data) < 40 or data[:8] != MAGIC_AUTH:
            raise CorruptCheckpointError(f"{name}: not a fedgrid checkpoint (bad header)")
        payload = data[40:]
        if not hmac.compare_digest(hmac.new(key, payload, hashlib.sha256).digest(), data[8:40]):
            raise CorruptCheckpointError(
                f"{name}: authentication failed (damaged, or not written with this key)"
            )
        return payload
    if data[:8] == MAGIC_AUTH:
        raise CorruptCheckpointError(f"{name}: an authenticated checkpoint: give its --state-key")
    if len(data) < 16 or data[:8] != MAGIC:
        raise CorruptCheckpointError(f"{name}: not a fedgrid checkpoint (bad header)")
    payload = data[16:]
    if xxhash.xxh3_64_intdigest(payload) != int.from_bytes(data[8:16], "little"):
        raise CorruptCheckpointError(f"{name}: checksum mismatch (file damaged or truncated)")
    return payload


@dataclass(frozen=True)
class Checkpoint:
    """One committed round."""

    round: int
    strategy: Mapping[str, Any]
    fleet: Mapping[str, Any]
    history: Sequence[Mapping[str, Any]]
    path: Path
    #: The differential privacy stage's state (``server/privacy.py``); empty without DP.
    privacy: Mapping[str, Any] = field(default_factory=dict)
    #: The influence caps' state (``server/influence.py``: late results' references).
    influence: Mapping[str, Any] = field(default_factory=dict)


def _mapped(path: Path) -> memoryview:
    """The file at ``path`` mapped copy-on-write: its tensors are read in place, not copied (an
    empty file is an empty buffer)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return memoryview(bytearray())
        return memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY))


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
        key: authenticates checkpoints with HMAC-SHA256 (``--state-key``, a file kept outside
            the state directory): written as ``FGCKPT2H``, and only such checkpoints, with a
            valid tag, are read.
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3, key: bytes | None = None) -> None:
        if keep < 2:
            raise ValueError(f"keep must be at least 2, got {keep}")
        if key is not None and len(key) < MIN_KEY_BYTES:
            raise ValueError(f"a state key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.keep = keep
        self.key = key
        self.db_path = self.dir / "history.sqlite"
        self._create_journal()

    def _create_journal(self) -> None:
        with self._db() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS rounds (round INTEGER PRIMARY KEY, metrics TEXT NOT NULL, committed_at REAL NOT NULL)"
            )

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """One transaction on the journal (committed, closed); the disk refusing it is a ``StorageError``."""
        try:
            db = sqlite3.connect(self.db_path, timeout=30)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=FULL")
                with db:
                    yield db
            finally:
                db.close()
        except (sqlite3.OperationalError, OSError) as exc:
            if is_storage_failure(exc):
                raise storage_error(exc, self.db_path) from None
            raise

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
        privacy: Mapping[str, Any] | None = None,
        influence: Mapping[str, Any] | None = None,
    ) -> Path:
        """Writes the checkpoint of ``server_round`` atomically (mode 0600), then records its
        metrics in SQLite.

        Raises:
            TypeError: the state holds a value a checkpoint cannot store (nothing written).
        """
        log.info("round %d: writing checkpoint", server_round)
        chunks = payload_chunks(
            {
                "round": server_round,
                "strategy": dict(strategy),
                "fleet": dict(fleet),
                "history": list(history),
                "privacy": dict(privacy or {}),
                "influence": dict(influence or {}),
            }
        )
        first = next(chunks)  # a value a checkpoint cannot hold raises here, before any file
        path = self.dir / checkpoint_name(server_round)
        tmp = path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)  # a leftover .tmp keeps its mode through O_CREAT
            with os.fdopen(fd, "wb") as f:
                # The payload streams from the state's own tensors (no copy of the model); its
                # checksum or tag, computed on the way, goes in the header's place at the end.
                seal = self._sealer()
                f.write(self._header(seal))
                for chunk in itertools.chain([first], chunks):
                    seal.update(chunk)
                    f.write(chunk)
                f.seek(0)
                f.write(self._header(seal))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(self.dir)
        except OSError as exc:
            tmp.unlink(missing_ok=True)  # the last good checkpoint stays; its space comes back
            if is_storage_failure(exc):
                raise storage_error(exc, tmp) from None
            raise
        self.sync_history(history)
        for _, old in self.checkpoints()[self.keep :]:
            old.unlink(missing_ok=True)
        return path

    def _sealer(self) -> Any:
        """What the header's checksum or tag is computed with, fed the payload (``update``)."""
        if self.key is not None:
            return hmac.new(self.key, digestmod=hashlib.sha256)
        return xxhash.xxh3_64()

    def _header(self, seal: Any) -> bytes:
        """The header of a checkpoint whose payload ``seal`` was fed: magic and HMAC tag, or magic
        and checksum."""
        if self.key is not None:
            return MAGIC_AUTH + seal.digest()
        return MAGIC + seal.intdigest().to_bytes(8, "little")

    @staticmethod
    def read(path: Path, key: bytes | None = None) -> Checkpoint:
        """Reads and verifies one checkpoint file (with ``key``: its HMAC-SHA256 tag).

        Raises:
            CheckpointFormatError: a checkpoint of an earlier format (named).
            CorruptCheckpointError: bad magic, checksum or tag mismatch, an undecodable payload,
                or a round that is not the one its file name says.
        """
        data = _mapped(path)
        if bytes(data[:8]) in OLD_FORMATS:
            raise CheckpointFormatError(
                f"{path.name}: checkpoint format {OLD_FORMATS[bytes(data[:8])]} is no longer read (this version writes "
                f"{MAGIC.decode()}: safetensors and JSON); move it away to start the run afresh"
            )
        payload = _verified(path.name, data, key)
        try:
            obj = content_of(payload)
            ckpt = Checkpoint(
                int(obj["round"]),
                obj["strategy"],
                obj["fleet"],
                obj["history"],
                path,
                obj.get("privacy") or {},
                obj.get("influence") or {},
            )
        except Exception as exc:
            raise CorruptCheckpointError(f"{path.name}: cannot decode: {exc}") from None
        named = _NAME.match(path.name)
        if named is not None and int(named.group(1)) != ckpt.round:
            raise CorruptCheckpointError(
                f"{path.name}: holds round {ckpt.round}, its name says round {int(named.group(1))}"
            )
        last = int(ckpt.history[-1]["round"]) if ckpt.history else None
        if last != ckpt.round:
            raise CorruptCheckpointError(
                f"{path.name}: holds round {ckpt.round}, but the history inside ends at round {last}"
            )
        return ckpt

    def load(self, server_round: int) -> Checkpoint:
        """The checkpoint of ``server_round`` (verified as ``read``).

        Raises:
            FileNotFoundError: none of that round is kept.
            CorruptCheckpointError: as ``read``.
        """
        return self.read(self.dir / checkpoint_name(server_round), self.key)

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies and agrees with the journal (``history.sqlite``);
        a corrupt newer one is reported and skipped. ``None``: a state directory with no
        checkpoint and no committed round in its journal (a new run).

        Raises:
            CheckpointFormatError: a checkpoint of an earlier format comes first (see the module docstring).
            RecoveryError: every checkpoint is unreadable (each named, with why), the journal
                records rounds past every checkpoint, or disagrees with the one found.
        """
        found = self.checkpoints()
        problems: list[str] = []
        for _, path in found:
            try:
                ckpt = self.read(path, self.key)
            except CheckpointFormatError:
                raise
            except CorruptCheckpointError as exc:
                log.error("corrupt checkpoint, falling back to the previous one: %s", exc)
                problems.append(str(exc))
                continue
            self._check_journal(ckpt, newest=found[0][0])
            return ckpt
        journal = self._journal_rounds()
        if problems:
            raise RecoveryError(
                f"state directory {self.dir}: no checkpoint is readable ({'; '.join(problems)}); "
                f"refusing to start a new run over it: restore a good checkpoint, or start over with --fresh"
            )
        if journal:
            raise RecoveryError(
                f"state directory {self.dir}: history.sqlite records {len(journal)} committed rounds "
                f"(up to round {max(journal)}) but no checkpoint is left; refusing to start a new run over "
                "it: restore the checkpoints, or start over with --fresh"
            )
        return None

    def _journal_rounds(self) -> dict[int, str]:
        with self._db() as db:
            return {int(r): str(m) for r, m in db.execute("SELECT round, metrics FROM rounds").fetchall()}

    def _check_journal(self, ckpt: Checkpoint, *, newest: int) -> None:
        """The journal agrees with ``ckpt``: it holds no round past ``newest`` (the newest
        checkpoint file, readable or not), at most one fewer than ``ckpt`` (it is written just
        after the checkpoint), and ``ckpt``'s own round as the checkpoint has it.

        Raises:
            RecoveryError: naming the checkpoint and the journal's rounds.
        """
        journal = self._journal_rounds()
        last = max(journal, default=0)
        where = f"state directory {self.dir}: {ckpt.path.name} (round {ckpt.round})"
        fix = "restore the state directory, or start over with --fresh"
        if last > newest:
            raise RecoveryError(
                f"{where}: history.sqlite records round {last} committed, and no checkpoint of it is left; {fix}"
            )
        if last < ckpt.round - 1:
            raise RecoveryError(
                f"{where}: history.sqlite records rounds up to {last} only: the checkpoint is not this run's; {fix}"
            )
        row = journal.get(ckpt.round)
        if row is not None and row != json.dumps(dict(ckpt.history[-1])):
            raise RecoveryError(
                f"{where}: history.sqlite records another round {ckpt.round} than the checkpoint's; {fix}"
            )

    def set_aside(self) -> Path | None:
        """Moves every checkpoint, the journal and the spilled updates into
        ``discarded-TIMESTAMP/`` (``--fresh``): a new run starts here, the old files stay for
        inspection. Returns that folder, or ``None`` when there was nothing to move."""
        updates = self.dir / "updates"
        if not self.checkpoints() and not self._journal_rounds() and not any(updates.glob("*/*")):
            return None  # a new state directory: nothing of a run to set aside
        names = [p for _, p in self.checkpoints()]
        names += [p for p in self.dir.iterdir() if p.name.startswith("history.sqlite") or p == updates]
        names += list(self.dir.glob("ckpt-*.tmp"))
        aside = self.dir / time.strftime("discarded-%Y%m%dT%H%M%S", time.gmtime())
        aside.mkdir(mode=0o700, exist_ok=True)
        for path in names:
            os.replace(path, aside / path.name)
        _fsync_dir(self.dir)
        self._create_journal()
        return aside

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
