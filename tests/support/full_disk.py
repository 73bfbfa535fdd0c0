"""Fault injection (a test utility, not production code): a full disk under one directory.

``full_disk(directory)`` makes every file opened for writing under ``directory`` (by ``open``
or ``os.open``) fail with ``OSError(ENOSPC)``, as a file system with no space left does; reads
and everything elsewhere go on. SQLite's own I/O is C code and not reached: the journal is
written after the checkpoint, which fails first.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
from pathlib import Path
from typing import Any, Iterator

__all__ = ["full_disk", "install_full_disk"]

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def install_full_disk(directory: str | os.PathLike[str]) -> Any:
    """Installs the fault for the rest of the process; returns a function that removes it."""
    root = Path(directory).resolve()
    real_open, real_os_open = builtins.open, os.open

    def under(path: Any) -> bool:
        try:
            return Path(os.fsdecode(path)).resolve().is_relative_to(root)
        except (TypeError, ValueError):
            return False  # a file descriptor, not a path

    def enospc(path: Any) -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fsdecode(path))

    def fake_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if any(c in mode for c in "wax+") and under(file):
            raise enospc(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & _WRITE_FLAGS and under(path):
            raise enospc(path)
        return real_os_open(path, flags, *args, **kwargs)

    builtins.open, os.open = fake_open, fake_os_open  # type: ignore[assignment]

    def remove() -> None:
        builtins.open, os.open = real_open, real_os_open  # type: ignore[assignment]

    return remove


@contextlib.contextmanager
def full_disk(directory: str | os.PathLike[str]) -> Iterator[None]:
    """The fault for the duration of the block."""
    remove = install_full_disk(directory)
    try:
        yield
    finally:
        remove()
