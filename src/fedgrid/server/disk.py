"""Storage failures of the coordinator's own disk, told apart from everything else.

A write that the disk refuses (no space, an I/O error, a quota, a read-only file system) is
not the client's fault and not a bug: the coordinator stops with one line naming the path and
the free space (``StorageError``), its last good checkpoint stays, and clients hear
UNAVAILABLE, so they wait and retry until it is back. SQLite reports the same conditions as
``sqlite3.OperationalError`` ("database or disk is full", "disk I/O error"), which are mapped
here too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sqlite3
import threading
from pathlib import Path
from typing import Callable, Iterator

from fedgrid.errors import StorageError

__all__ = [
    "STORAGE_ERRNOS",
    "is_storage_failure",
    "storage_error",
    "storage_errors",
    "free_space",
    "StorageGuard",
]

#: The ``errno`` values of a disk that refuses writes.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EROFS, errno.EFBIG})
#: What SQLite says when its file system refuses a write.
_SQLITE_STORAGE = ("disk is full", "disk i/o error", "readonly database", "unable to open database")


def is_storage_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the disk refusing a write (an ``OSError`` of ``STORAGE_ERRNOS``, or
    SQLite's equivalent)."""
    if isinstance(exc, StorageError):
        return True
    if isinstance(exc, sqlite3.OperationalError):
        return any(text in str(exc).lower() for text in _SQLITE_STORAGE)
    return isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def free_space(path: str | os.PathLike[str]) -> str:
    """``"N MiB free of M MiB"`` on the file system holding ``path`` (its nearest existing
    ancestor), or ``"free space unknown"``."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return "free space unknown"
    return f"{_mib(usage.free)} free of {_mib(usage.total)}"


def storage_error(
    exc: BaseException, path: str | os.PathLike[str], *, doing: str = "writing"
) -> StorageError:
    """The one-line ``StorageError`` of ``exc`` (a storage failure, see ``is_storage_failure``)
    met ``doing`` ``path``: the path, the cause and the free space there."""
    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, OSError) and exc.errno is not None:
        cause = os.strerror(exc.errno)
    else:
        cause = str(exc)
    where = exc.filename if isinstance(exc, OSError) and exc.filename else path
    return StorageError(f"storage error {doing} {where}: {cause} ({free_space(where)})")


@contextlib.contextmanager
def storage_errors(path: str | os.PathLike[str], *, doing: str = "writing") -> Iterator[None]:
    """Turns a storage failure inside the block into its one-line ``StorageError`` (``path``
    is named when the ``OSError`` names no file); any other error passes unchanged."""
    try:
        yield
    except (OSError, sqlite3.OperationalError) as exc:
        if not is_storage_failure(exc):
            raise
        raise storage_error(exc, path, doing=doing) from None


class StorageGuard:
    """A fleet's first storage failure: once the disk refused an update, ``check`` raises it
    from every round method, so the engine stops instead of counting the round's clients as failed.

    Args:
        on_failure: called once, at the first failure (the fleet's ``interrupt``).
    """

    def __init__(self, on_failure: Callable[[], None]) -> None:
        self.failure: StorageError | None = None
        self._on_failure = on_failure
        self._lock = threading.Lock()

    def check_failure(self, exc: BaseException, path: str | os.PathLike[str]) -> None:
        """Raises the ``StorageError`` of ``exc`` met under ``path``, recorded, when ``exc`` is a
        storage failure (``is_storage_failure``); returns otherwise."""
        if not is_storage_failure(exc):
            return
        error = storage_error(exc, path)
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = error
        if first:
            self._on_failure()
        raise error from None

    @contextlib.contextmanager
    def watch(self, path: str | os.PathLike[str]) -> Iterator[None]:
        """Records and raises a storage failure inside the block as ``check_failure`` does; any
        other error passes unchanged."""
        try:
            yield
        except Exception as exc:
            self.check_failure(exc, path)
            raise

    def check(self) -> None:
        """Raises the recorded failure, if any."""
        if self.failure is not None:
            raise self.failure
