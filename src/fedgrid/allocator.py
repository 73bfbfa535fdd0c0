"""glibc's allocator, set for what the process does: a coordinator returns large buffers to the
system (``return_large_buffers_to_the_system``), the batched simulation keeps them
(``keep_large_buffers``).

glibc's allocator raises its mmap threshold as large blocks are freed, after which
freed model-sized buffers (received tensors, accumulators) stay in the heap instead of
going back to the system; a coordinator that handled a round of large updates then keeps
several models' worth of memory it no longer uses. Pinning the threshold makes every
buffer above it its own mapping, returned when freed. Measured with
``benchmarks/coordinator.py`` (50 updates of a 100 MB model): memory after the upload
phase fell from 4.4x to 1.9x the model net of the process baseline.

The threshold sits just above the largest gRPC message, not at 1 MiB: every chunk of a
model stream is a buffer of a little over 1 MiB (received message, encoded frame), and as
a mapping of its own each one was mapped, faulted in page by page and unmapped again:
about 130 ms per 400 MB streamed, a third of an upload's time. Under the threshold they
reuse the same heap memory; model-sized buffers still go back to the system.

The batched simulation engine wants the opposite: it allocates and frees the same stacked
activation and gradient buffers (tens of MB) at every step, and with glibc's defaults each
is a fresh mapping whose pages fault in again. Keeping such buffers in the heap
(``keep_large_buffers``) made a 100-client MLP round on CPU 20% faster
(``benchmarks/simulation.py``: 1.26 s -> 1.00 s).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from fedgrid.constants import MAX_MESSAGE_BYTES

__all__ = [
    "return_large_buffers_to_the_system",
    "keep_large_buffers",
    "MMAP_THRESHOLD_MAX",
    "MESSAGE_BUFFER_BYTES",
]

log = logging.getLogger(__name__)

#: glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2): the biggest buffer it can keep in the heap.
MMAP_THRESHOLD_MAX = 32 << 20

#: The coordinator's mmap threshold: a gRPC message of the largest size, plus its framing and
#: Python's object header, stays under it.
MESSAGE_BUFFER_BYTES = MAX_MESSAGE_BYTES + (64 << 10)

_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers from <malloc.h>
_M_MMAP_THRESHOLD = -3


def _mallopt(settings: dict[int, int]) -> bool:
    """Applies glibc ``mallopt`` settings; returns whether all applied (not glibc: no-op)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        applied = all(bool(libc.mallopt(param, value)) for param, value in settings.items())
    except (OSError, AttributeError):
        return False
    log.debug("mallopt(%s): %s", settings, applied)
    return applied


def return_large_buffers_to_the_system(threshold: int = MESSAGE_BUFFER_BYTES) -> bool:
    """Pins glibc's mmap threshold; returns whether it applied (not glibc: no-op)."""
    return _mallopt({_M_MMAP_THRESHOLD: threshold})


def keep_large_buffers(threshold: int = MMAP_THRESHOLD_MAX, trim: int = 4 << 30) -> bool:
    """Serves buffers under ``threshold`` bytes from the heap and keeps up to ``trim`` bytes
    of free heap instead of returning it at once; returns whether it applied."""
    return _mallopt({_M_MMAP_THRESHOLD: threshold, _M_TRIM_THRESHOLD: trim})
