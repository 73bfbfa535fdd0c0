"""The files of a certificate directory: atomic writes, its JSON registries and its lock.

Every write is atomic (a temporary file, then ``os.replace``) so that a reader never sees half a
file, and secrets are created with their final mode. ``index.json`` and ``tokens.json`` change
only under ``locked``, an exclusive ``flock`` on ``DIR/.lock``. ``fedgrid.pki`` (the directory
format, enrollment) and ``fedgrid.ops.pki`` (administering the CA) build on these.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
from pathlib import Path
from typing import Any, Iterator

from fedgrid.errors import PKIError

__all__ = ["LOCK", "locked", "read_json", "write_atomic", "write_json"]

#: The lock file of a certificate directory.
LOCK = ".lock"


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int) -> None:
    """Writes ``path`` whole or not at all, with ``mode`` from the file's creation: a key is
    never readable by others, not even for a moment, and a reader never sees half a file.

    Args:
        path: the file; its folder must exist.
        data: the whole content.
        mode: permission bits, e.g. ``0o600`` for a key (exactly these, whatever the umask).
    Raises:
        OSError: the folder is missing or not writable (nothing is left behind).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # exactly mode, whatever the umask (0644 files stay readable)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)


def write_json(path: Path, data: dict[str, Any], mode: int) -> None:
    """Writes ``data`` as indented, key-sorted JSON, atomically (``write_atomic``) with ``mode``."""
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode(), mode)


def read_json(path: Path, *, missing: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON object in ``path`` (a version 1 fedgrid file), or ``missing`` where it does not exist.

    Raises:
        PKIError: the file is missing (and ``missing`` is None), not JSON, or not a version 1 object.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        if missing is not None:
            return missing
        raise PKIError(
            f"{path}: missing; is {path.parent} a certificate directory (fedgrid certs init)?"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PKIError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("version") != 1:
        raise PKIError(f"{path}: not a fedgrid {path.stem} file (expected a JSON object with version 1)")
    return data


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Holds the directory's exclusive lock: one writer of index.json and tokens.json at a
    time, across threads (each call opens its own file description) and processes."""
    if not directory.is_dir():
        raise PKIError(
            f"{directory}: no such certificate directory; create a CA with `fedgrid certs init --dir {directory}`"
        )
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
