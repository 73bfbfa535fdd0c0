"""``StorageMeter``: the bytes of the torch storages that ops create, for memory tests that must
fail when a full-model copy is added (tests/integration/test_coordinator_memory.py,
test_client_memory.py)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["StorageMeter"]


class StorageMeter(TorchDispatchMode):
    """Bytes of the tensor storages that ops create while it is active (in this thread):
    ``total`` ever created, ``peak`` alive at once, ``now`` still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = self.total = 0
        self._live: set[int] = set()
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            with self._lock:
                if nbytes == 0 or ptr in inputs or ptr in self._live:
                    continue  # a view, an in-place op, or a storage already counted
                self._live.add(ptr)
                self.now += nbytes
                self.total += nbytes
                self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._free, ptr, nbytes)
        return out

    def _free(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            self._live.discard(ptr)
            self.now -= nbytes
