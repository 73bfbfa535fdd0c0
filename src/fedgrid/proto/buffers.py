"""Receive buffers reused across transfers.

A receiver rebuilds each tensor of a model stream in a buffer of the tensor's size
(``serde.ModelAssembler``). A fresh model-sized buffer is a fresh mapping, and its pages
fault in as the chunks are copied into it: about 0.9 GB/s on this VM, against 11-23 GB/s
for copies into memory already mapped, so the copy into fresh memory was most of a
receiver's cost (bare grpcio, which keeps nothing, allocates nothing that large). Rounds
repeat tensor sizes exactly, so the buffers of one transfer serve the next.

Safety: a buffer is handed out again only once nothing references its memory. The pool
keeps the array that owns the memory (``owner``) and hands out a second array over it
(``lease``) whose base is a ``memoryview`` of the owner, not the owner itself: numpy then
roots every view of the lease (slices, ``.view(dtype)``, ``reshape``) at the lease, and
torch's ``from_numpy``, ``frombuffer`` and ``Tensor.numpy`` hold a reference to the array
or tensor they wrap. Whatever reaches the memory through Python therefore keeps the
lease alive, and the lease's weak reference fires only when none of it is left; only then
does the owner go back to the free list. (Were the lease a plain view of the owner, numpy
would root further views at the owner and the lease could die while they live.)

Bounds: free buffers are capped at ``max_free_bytes`` (``BUFFER_POOL_BYTES``); a buffer
returned over the cap is dropped at once, so it goes back to the system exactly when it
would have without the pool (``allocator.py``). Free buffers unused for ``idle_s``
(``BUFFER_POOL_IDLE_S``) are dropped by a background thread, which runs only while the
pool holds something: an idle process gives the memory back.

Buffers are reused on an exact size match only. A larger free buffer could serve a smaller
tensor through a view, but the whole buffer would then stay pinned for as long as the
small tensor lives (a bias kept by a client pins a weight matrix's worth of memory).

Buffers come uninitialized (old contents included): the caller must write every byte
before it exposes one (the assembler raises on a short tensor before it makes one).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import numpy as np

from fedgrid.constants import BUFFER_POOL_BYTES, BUFFER_POOL_IDLE_S

__all__ = ["BufferPool", "PoolStats", "MIN_POOLED_BYTES", "receive_buffers"]

#: Smaller buffers are not pooled: malloc serves them from its heap, which reuses memory
#: already (glibc's mmap threshold is at least 128 KiB and the coordinator pins it at about
#: 4 MiB); pooling them would only add bookkeeping per tensor.
MIN_POOLED_BYTES = 1 << 20


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool: free buffers, buffers handed out and not yet returned, and
    how many requests reused a buffer or allocated one."""

    free_bytes: int
    free_buffers: int
    leased_bytes: int
    leased_buffers: int
    reused: int
    allocated: int


@dataclass
class _Free:
    owner: np.ndarray
    since: float  # when it came back (the pool's clock)


class BufferPool:
    """Uninitialized byte buffers, reused once nothing references them.

    Args:
        max_free_bytes: cap on the bytes of free (returned, unused) buffers kept; 0 pools
            nothing (every request allocates, as without a pool).
        idle_s: a free buffer unused this long is dropped.
        min_bytes: requests under this size are plain allocations.
        clock: monotonic seconds (tests pass their own).

    Raises:
        ValueError: a negative size or idle time.
    """

    def __init__(
        self,
        *,
        max_free_bytes: int = BUFFER_POOL_BYTES,
        idle_s: float = BUFFER_POOL_IDLE_S,
        min_bytes: int = MIN_POOLED_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_free_bytes < 0 or min_bytes < 0:
            raise ValueError(
                f"max_free_bytes and min_bytes must be >= 0, got {max_free_bytes} and {min_bytes}"
            )
        if not idle_s > 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s}")
        self.max_free_bytes = max_free_bytes
        self.idle_s = idle_s
        self.min_bytes = max(1, min_bytes)
        self._clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._free: list[_Free] = []  # in the order they came back, oldest first
        self._free_bytes = 0
        self._leases: dict[int, tuple[weakref.ref[np.ndarray], np.ndarray]] = {}  # id(ref) -> (ref, owner)
        self._leased_bytes = 0
        # Weak-reference callbacks run wherever the last reference dies, also inside this
        # pool's own locked code (a garbage collection there): they only queue the return,
        # and whoever holds or next takes the lock settles it.
        self._returns: deque[tuple[weakref.ref[np.ndarray], float]] = deque()  # (lease's ref, when)
        self._reaper: threading.Thread | None = None
        self._reused = 0
        self._allocated = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A writable ``uint8`` array of ``nbytes`` bytes, contents undefined.

        The memory is handed out again only after the array and everything made from it
        (views, tensors) are gone.
        """
        if nbytes < self.min_bytes or self.max_free_bytes == 0:
            return np.empty(nbytes, dtype=np.uint8)
        dropped: list[np.ndarray] = []
        with self._lock:
            dropped += self._settle()
            owner = self._pop_free(nbytes)
            if owner is None:
                owner = np.empty(nbytes, dtype=np.uint8)  # numpy asks for huge pages on large buffers
                self._allocated += 1
            else:
                self._reused += 1
            lease = np.frombuffer(owner.data, dtype=np.uint8)  # base: a memoryview of the owner
            ref = weakref.ref(lease, self._on_return)
            self._leases[id(ref)] = (ref, owner)
            self._leased_bytes += nbytes
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="fedgrid-buffers", daemon=True)
                self._reaper.start()
        del dropped
        self._drain()
        return lease

    def stats(self) -> PoolStats:
        with self._lock:
            dropped = self._settle()
            out = PoolStats(
                self._free_bytes,
                len(self._free),
                self._leased_bytes,
                len(self._leases),
                self._reused,
                self._allocated,
            )
        del dropped
        self._drain()
        return out

    def release_idle(self) -> int:
        """Drops the free buffers unused for ``idle_s``; returns the bytes dropped."""
        with self._lock:
            dropped = self._settle() + self._expire()
        freed = sum(len(o) for o in dropped)
        del dropped
        self._drain()
        return freed

    def clear(self) -> int:
        """Drops every free buffer now; returns the bytes dropped (leased ones stay leased)."""
        with self._lock:
            dropped = self._settle() + [f.owner for f in self._free]
            self._free.clear()
            self._free_bytes = 0
            self._changed.notify_all()
        freed = sum(len(o) for o in dropped)
        del dropped
        self._drain()
        return freed

    def wait_idle(self, timeout: timedelta) -> bool:
        """Waits until the pool holds no free buffers (returned ones dropped as idle or
        cleared); returns whether it did within ``timeout``."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._lock:
            while True:
                self._settle()
                if not self._free:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)

    # -- internals ---------------------------------------------------------------------------
    def _on_return(self, ref: weakref.ref[np.ndarray]) -> None:
        self._returns.append((ref, self._clock()))
        self._drain()

    def _drain(self) -> None:
        """Settles queued returns unless another holder of the lock will (it drains after
        it lets go: a return queued while it held the lock is seen then)."""
        while self._returns and self._lock.acquire(blocking=False):
            try:
                dropped = self._settle()
            finally:
                self._lock.release()
            del dropped

    def _settle(self) -> list[np.ndarray]:
        """Moves returned leases to the free list (lock held); returns the owners dropped
        for the cap, for the caller to let go of once it has released the lock."""
        dropped: list[np.ndarray] = []
        while self._returns:
            ref, when = self._returns.popleft()
            entry = self._leases.pop(id(ref), None)
            if entry is None:
                continue
            owner = entry[1]
            self._leased_bytes -= len(owner)
            if len(owner) > self.max_free_bytes:
                dropped.append(owner)
                continue
            while self._free_bytes + len(owner) > self.max_free_bytes:
                oldest = self._free.pop(0)
                self._free_bytes -= len(oldest.owner)
                dropped.append(oldest.owner)
            self._free.append(_Free(owner, when))
            self._free_bytes += len(owner)
            self._changed.notify_all()
        return dropped

    def _pop_free(self, nbytes: int) -> np.ndarray | None:
        for i in range(
            len(self._free) - 1, -1, -1
        ):  # the most recently returned: the likeliest still in cache
            if len(self._free[i].owner) == nbytes:
                owner = self._free.pop(i).owner
                self._free_bytes -= nbytes
                return owner
        return None

    def _expire(self) -> list[np.ndarray]:
        cutoff = self._clock() - self.idle_s
        dropped: list[np.ndarray] = []
        while self._free and self._free[0].since <= cutoff:
            oldest = self._free.pop(0)
            self._free_bytes -= len(oldest.owner)
            dropped.append(oldest.owner)
        if dropped:
            self._changed.notify_all()
        return dropped

    def _reap(self) -> None:
        """The background thread: drops idle buffers; ends when the pool holds nothing."""
        with self._lock:
            while True:
                dropped = self._settle() + self._expire()
                del dropped  # under the lock: this thread only ever frees idle memory
                if not self._free and not self._leases and not self._returns:
                    self._reaper = None
                    return
                # Bounded even with nothing free: a return queued by a collection on this
                # very thread while it held the lock is settled within idle_s.
                wait = self.idle_s if not self._free else self._free[0].since + self.idle_s - self._clock()
                self._changed.wait(max(0.0, min(wait, self.idle_s)))


_shared: BufferPool | None = None
_shared_lock = threading.Lock()


def receive_buffers() -> BufferPool:
    """The process's pool of receive buffers (created on first use, from ``fedgrid.constants``)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = BufferPool()
        return _shared
