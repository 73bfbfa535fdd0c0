"""Accepted updates spilled to disk, folded later in a canonical order.

Each accepted update of a round is written (atomically) as one safetensors file. The
round's results then hold ``SpilledState`` mappings that read one tensor at a time, so the
coordinator's memory while aggregating stays O(model size) however many clients report,
and folding them sorted by client makes the aggregate bit-identical whatever order the
uploads arrived in. With a state directory the files also survive a crash: a round redone
after a restart takes the updates whose files had landed without asking their clients again.

Writing a file and its fsync cost more than receiving and checking the update (400 MB:
about 250 ms against 80 ms here), so neither has to come before the client's reply:

- without a state directory (nothing to resume from), updates that fit a memory budget
  (``SPILL_MEMORY_BYTES``, ``FEDGRID_SPILL_MEMORY_BYTES``) are held in memory (``HeldState``)
  and written back only when the budget needs their room: an upload that does not fit
  queues the oldest held updates for a background thread, which writes each to its file and
  then frees it, and is itself streamed to its file before its reply (so the budget is
  never exceeded). An update under ``WRITE_BACK_BYTES`` is never written: its file would cost
  more than the memory it frees. Held updates go when their round is cleared. Writing them
  eagerly in the background took a core from the next upload: 0.31 of grpcio's upload rate
  against 0.75 this way (``benchmarks/transport.py``, 2 cores);
- under a state directory every update is written and renamed into place before the reply
  (so a killed coordinator process finds it: the kernel's page cache outlives the
  process), and its fsync runs in the background.

What survives a crash of the coordinator under a state directory:
- of a process crash (killed, OOM, a bug): every acknowledged update; the round redone
  after the restart takes it without asking its client again;
- of a machine crash: every update whose fsync completed; one acknowledged within the
  last moments before the crash may be lost, and the redone round asks its client again;
- never half of one: a file is renamed into place only once complete.
The fleet calls ``flush`` when a round closes, so every update of a closed round is written
and synced before the strategy sees it and before the round's checkpoint.

The files themselves (``SpillWriter``, ``SpilledState``) live in ``spill_files``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fedgrid.clock import MONOTONIC, Clock
from fedgrid.constants import SPILL_MEMORY_BYTES, TRANSFER_TIMEOUT_S
from fedgrid.server.spill_files import SAFETENSORS_DTYPES, SpilledState, SpillWriter
from fedgrid.types import ClientInfo, FitRes, TensorSpec

__all__ = ["SpilledState", "HeldState", "UpdateSpill", "UpdateWriter", "SpillWriter", "WRITE_BACK_BYTES"]

log = logging.getLogger(__name__)

#: Without a state directory, a held update smaller than this is never written back: its
#: file would cost more (create, write, read back) than the memory it frees. It stays
#: reserved against the budget until its round is cleared.
WRITE_BACK_BYTES = 1 << 20


class UpdateWriter(Protocol):
    """Takes one update tensor by tensor: ``SpillWriter`` (to its file now) or one that holds
    it in memory until a background write (``UpdateSpill.writer`` chooses)."""

    def write(self, name: str, tensor: torch.Tensor) -> None: ...

    def commit(self) -> Mapping[str, torch.Tensor]: ...

    def abort(self) -> None: ...


class HeldState(Mapping[str, torch.Tensor]):
    """An accepted update held in memory until its file is written, then read from the file
    (like ``SpilledState``) and no longer held. Its tensors must not be changed in place."""

    def __init__(self, path: Path, tensors: "OrderedDict[str, torch.Tensor]") -> None:
        self.path = path
        self._names = list(tensors)
        self._tensors: OrderedDict[str, torch.Tensor] | None = tensors
        self._disk: SpilledState | None = None

    @property
    def on_disk(self) -> bool:
        """Whether its file landed (and the memory was let go)."""
        return self._disk is not None

    def _landed(self, disk: SpilledState) -> None:
        self._disk = disk  # readers find one of the two at every moment
        self._tensors = None

    def __getitem__(self, name: str) -> torch.Tensor:
        tensors = self._tensors
        if tensors is not None:
            return tensors[name]
        assert self._disk is not None
        return self._disk[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def items(self):  # type: ignore[override]
        tensors = self._tensors
        if tensors is not None:
            yield from tensors.items()
        else:
            assert self._disk is not None
            yield from self._disk.items()


class _HeldWriter:
    """Keeps an update's tensors (references, no copy) under a reservation of the spill's
    memory budget; ``commit`` hands it to the spill, which holds it until the budget needs
    its room."""

    def __init__(
        self,
        spill: "UpdateSpill",
        path: Path,
        specs: Mapping[str, TensorSpec],
        metadata: Mapping[str, str],
        nbytes: int,
    ) -> None:
        self._spill, self.path, self._specs, self._metadata, self.nbytes = (
            spill,
            path,
            specs,
            metadata,
            nbytes,
        )
        self._tensors: dict[str, torch.Tensor] = {}
        self._done = False  # committed or aborted: the reservation is no longer this writer's

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self._specs[name]
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != tuple(spec.shape):
            raise ValueError(
                f"tensor '{name}': {tensor.dtype} {list(tensor.shape)}, the update holds {spec.dtype} {list(spec.shape)}"
            )
        self._tensors[name] = tensor.detach()

    def commit(self) -> HeldState:
        missing = [n for n in self._specs if n not in self._tensors]
        if missing:
            raise ValueError(f"spill of {self.path.name} lacks tensors {missing[:3]}")
        state = HeldState(self.path, OrderedDict((n, self._tensors[n]) for n in self._specs))
        self._done = True
        self._spill._keep(_Held(state, self._specs, self._metadata, self.nbytes))
        return state

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._tensors.clear()
            self._spill._release(self.nbytes)


@dataclass
class _Held:
    """An accepted update held in memory: kept until the budget needs its room, then
    pending (queued for, or in, its background write)."""

    state: HeldState
    specs: Mapping[str, TensorSpec]
    metadata: Mapping[str, str]
    nbytes: int
    cancelled: bool = False


class UpdateSpill:
    """Spill directory for one coordinator.

    Args:
        directory: where round folders go; ``None`` uses a private temporary directory
            (removed by ``close``), whose files are not fsynced: nothing reads them after a
            crash. Under a state directory they are, so a restart can trust them.
        memory_bytes: without a state directory, the budget of updates held in memory (see
            the module's docstring); 0 writes every update before its reply. Under a state directory every update is written before its
            reply (and fsynced after it).
        clock: the time ``flush``'s timeout is measured in (the fleet's; ``fedgrid.clock``).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        memory_bytes: int = SPILL_MEMORY_BYTES,
        clock: Clock = MONOTONIC,
    ) -> None:
        if memory_bytes < 0:
            raise ValueError(f"memory_bytes must be >= 0, got {memory_bytes}")
        self.clock = clock
        self._temporary = directory is None
        self.durable = not self._temporary
        self.memory_bytes = memory_bytes
        self.dir = Path(tempfile.mkdtemp(prefix="fedgrid-updates-")) if directory is None else Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._held = 0  # bytes reserved by held updates: being received, kept, or being written back
        self._kept: dict[Path, _Held] = {}  # accepted and in memory, oldest first
        self._pending: dict[Path, _Held] = {}  # queued for (or in) their background write
        self._writing = 0  # bytes of the pending ones: freed when their writes land
        self._syncing = 0  # fsyncs queued or running
        self._writes: ThreadPoolExecutor | None = None

    @property
    def held_bytes(self) -> int:
        """Bytes of updates held in memory now (in flight, or accepted and not yet written)."""
        return self._held

    def _round_dir(self, task_id: str) -> Path:
        return self.dir / task_id

    def writer(
        self,
        *,
        task_id: str,
        client: ClientInfo,
        specs: Mapping[str, TensorSpec],
        num_examples: int,
        metrics: Mapping[str, float],
        delta: bool = False,
    ) -> UpdateWriter | None:
        """A writer for one update, or ``None`` when a dtype cannot be spilled that way (then
        ``put`` the finished update). While the update fits the memory budget it is held;
        otherwise older held updates are queued for writing back, to make room for the next
        one, and this one streams into its file."""
        if any(spec.dtype not in SAFETENSORS_DTYPES for spec in specs.values()):
            return None
        folder = self._round_dir(task_id)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{client.client_id}.safetensors"
        metadata = self._metadata(client, list(specs), num_examples, metrics)
        if delta:  # FitRes.delta, restored with the update after a restart
            metadata["delta"] = "1"
        nbytes = sum(spec.nbytes for spec in specs.values())
        if self.durable:  # on disk before the reply, synced in the background
            return SpillWriter(path, specs, metadata, durable=True, sync_later=self._sync_later)
        with self._lock:
            if 0 < self.memory_bytes and nbytes <= self.memory_bytes - self._held:
                self._held += nbytes
                return _HeldWriter(self, path, specs, metadata, nbytes)
            evicted = (
                self._evict(nbytes - (self.memory_bytes - self._held)) if nbytes <= self.memory_bytes else []
            )
        for held in evicted:
            self._executor().submit(self._write, held)
        return SpillWriter(path, specs, metadata, durable=False)

    def _evict(self, needed: int) -> list[_Held]:
        """Moves the oldest kept updates (not the small ones) to pending until they, with
        the writes already pending, free ``needed`` bytes; returns them, to be written back
        (lock held)."""
        evicted: list[_Held] = []
        for path, held in list(self._kept.items()):
            if self._writing >= needed:
                break
            if held.nbytes < WRITE_BACK_BYTES:
                continue
            del self._kept[path]
            self._pending[path] = held
            self._writing += held.nbytes
            evicted.append(held)
        return evicted

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._writes is None:
                self._writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedgrid-spill")
            return self._writes

    def _sync_later(self, path: Path) -> None:
        """Queues the fsync of ``path`` (renamed into place); ``flush`` waits for it."""
        with self._lock:
            self._syncing += 1
        self._executor().submit(self._sync, path)

    def _sync(self, path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            fd = os.open(path.parent, os.O_RDONLY)  # the rename too
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except FileNotFoundError:
            pass  # discarded meanwhile
        except OSError:
            log.exception("could not fsync %s", path)
        finally:
            with self._lock:
                self._syncing -= 1
                self._changed.notify_all()

    def _keep(self, held: _Held) -> None:
        """An accepted update stays in memory, reserved, until the budget needs its room or
        its round is cleared."""
        with self._lock:
            self._kept[held.state.path] = held

    def _forget(self, paths: list[Path]) -> None:
        """Releases the reservations of kept updates (lock held)."""
        for path in paths:
            self._held -= self._kept.pop(path).nbytes
        if paths:
            self._changed.notify_all()

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes
            self._changed.notify_all()

    def _write(self, held: _Held) -> None:
        """The background write of a held update; once its file is in place the memory goes."""
        state = held.state
        writer: SpillWriter | None = None
        try:
            if held.cancelled:
                return
            writer = SpillWriter(state.path, held.specs, held.metadata, durable=self.durable)
            for name, tensor in state.items():
                writer.write(name, tensor)
            writer.sync()
            with self._lock:  # a discard or clear either comes first (no rename) or removes the file after
                if held.cancelled:
                    return
                disk = writer.rename()
            writer = None
            state._landed(disk)
        except Exception:  # the update stays valid in memory, only not crash-safe
            log.exception("could not spill %s; the update stays in memory", state.path)
        finally:
            if writer is not None:
                writer.abort()
            with self._lock:
                if self._pending.get(state.path) is held:
                    del self._pending[state.path]
                self._writing -= held.nbytes
                self._held -= held.nbytes
                self._changed.notify_all()

    def flush(self, *, timeout: timedelta = timedelta(seconds=TRANSFER_TIMEOUT_S)) -> bool:
        """Waits until the background writes queued so far have landed and, under a state
        directory, every update is synced; returns whether they did within ``timeout`` (if
        not, the rest stay valid and land later). Kept updates stay in memory."""
        deadline = self.clock.now() + timeout.total_seconds()
        with self._lock:
            while (self._pending or self._syncing) and self.clock.now() < deadline:
                self.clock.wait_until(self._changed, deadline)
            done = not self._pending and not self._syncing
        if not done:
            log.warning(
                "%d held updates not yet spilled after %.0fs", len(self._pending), timeout.total_seconds()
            )
        return done

    @staticmethod
    def _metadata(
        client: ClientInfo, names: list[str], num_examples: int, metrics: Mapping[str, float]
    ) -> dict[str, str]:
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
        if result.delta:
            meta["delta"] = "1"
        save_file({k: v.contiguous() for k, v in result.state.items()}, str(tmp), metadata=meta)
        if self.durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        spilled = SpilledState(path, names)  # a Mapping[str, Tensor] that reads the file on access
        return FitRes(result.client, spilled, result.num_examples, result.metrics, result.delta)  # type: ignore[arg-type]

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
                out[cid] = FitRes(
                    assigned[cid],
                    SpilledState(path, names),  # type: ignore[arg-type]
                    int(meta["num_examples"]),
                    metrics,
                    meta.get("delta") == "1",
                )
            except Exception:  # a damaged spill file only costs that client a retrain
                path.unlink(missing_ok=True)
        return out

    def discard(self, *, task_id: str, client_id: str) -> None:
        path = self._round_dir(task_id) / f"{client_id}.safetensors"
        with self._lock:
            held = self._pending.get(path)
            if held is not None:
                held.cancelled = True
            if path in self._kept:
                self._forget([path])
            path.unlink(missing_ok=True)

    def clear(self, *, keep: str | Collection[str] | None = None) -> None:
        """Removes every round folder but those of the task ids ``keep`` (held updates of
        the removed rounds are not written)."""
        kept = {keep} if isinstance(keep, str) else set(keep or ())
        with self._lock:
            for path, held in self._pending.items():
                if path.parent.name not in kept:
                    held.cancelled = True
            self._forget([path for path in self._kept if path.parent.name not in kept])
        for folder in self.dir.iterdir():
            if folder.is_dir() and folder.name not in kept:
                shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        """Waits for the writes and syncs under a state directory; a temporary one is removed."""
        if self._temporary:
            with self._lock:
                for held in self._pending.values():
                    held.cancelled = True
                self._forget(list(self._kept))
        else:
            self.flush()
        if self._writes is not None:
            self._writes.shutdown(wait=True)
        if self._temporary:
            shutil.rmtree(self.dir, ignore_errors=True)
