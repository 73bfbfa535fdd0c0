"""What a client keeps across rounds, on disk: the uplink's error-feedback residuals and the
``Client``'s own ``state_dict``, written atomically after every fit task and restored when a
client of the same name rejoins the same run (``fedgrid.client.runtime.run_client(state_path=...)``).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from fedgrid.client.api import Client

if TYPE_CHECKING:
    from fedgrid.client.runtime import Connection

__all__ = ["STATE_FORMAT", "save_client_state", "load_client_state", "restore_client_state"]

log = logging.getLogger(__name__)

STATE_FORMAT = "fedgrid-client-state/1"


def save_client_state(
    path: str | os.PathLike[str],
    *,
    run_id: str,
    server_round: int,
    client: Client,
    conn: "Connection | None" = None,
    name: str = "",
    uplink: Mapping[str, Any] | None = None,
) -> None:
    """Writes the client's state across rounds to ``path`` atomically (temporary file, fsync, rename).

    The file holds ``{"format", "run_id", "round", "name", "uplink": {codec: encoder state},
    "client": client.state_dict() or None}``, readable with ``torch.load(weights_only=True)``.
    ``name`` and ``uplink`` come from ``conn`` (its identity, its encoders' state) unless
    given: a save that finishes later (``fedgrid.client.runtime``) takes them when the upload ends.

    Raises:
        OSError: the file could not be written (``path`` is left as it was).
    """
    target = Path(path)
    hook = getattr(client, "state_dict", None)
    if conn is not None:
        name = name or conn.name  # under mTLS, its certificate's identity
        uplink = conn.uplink_state_dict() if uplink is None else uplink
    state = {
        "format": STATE_FORMAT,
        "run_id": run_id,
        "round": server_round,
        "name": name or client.name,
        "uplink": dict(uplink or {}),
        "client": hook() if callable(hook) else None,
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    try:  # make the rename itself durable
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # not every filesystem lets a directory be fsynced


def load_client_state(path: str | os.PathLike[str], *, name: str) -> dict[str, Any] | None:
    """Reads a state that ``save_client_state`` wrote for the client called ``name``.

    Returns ``None`` when there is no file, and (logging an error that names the file and
    what is wrong with it) when it is unreadable, not a fedgrid client state, or another
    client's: such a file is ignored, and replaced after the next fit task.
    """
    target = Path(path)
    if not target.exists():
        return None
    try:
        # weights_only: tensors and plain containers only, so a tampered file cannot run code.
        state = torch.load(target, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for a truncated or foreign file
        log.error("client state %s is unreadable, ignoring it (%s: %s)", target, type(exc).__name__, exc)
        return None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        log.error("client state %s is not a %s file, ignoring it", target, STATE_FORMAT)
        return None
    if not isinstance(state.get("run_id"), str) or not isinstance(state.get("uplink"), dict):
        log.error("client state %s lacks its run id or uplink state, ignoring it", target)
        return None
    if state.get("name") != name:
        log.error(
            "client state %s belongs to client %r, not %r: ignoring it", target, state.get("name"), name
        )
        return None
    return state


def restore_client_state(
    conn: "Connection", client: Client, saved: Mapping[str, Any], path: str | os.PathLike[str]
) -> bool:
    """Restores ``saved`` if it is from the run ``conn`` joined; says whether it did."""
    if saved["run_id"] != conn.run_id:
        log.warning(
            "client state %s is from run %s, the coordinator runs %s: starting afresh",
            path,
            saved["run_id"],
            conn.run_id,
        )
        return False
    try:
        conn.load_uplink_state_dict(saved["uplink"])
        if saved.get("client"):
            client.load_state_dict(saved["client"])
    except Exception as exc:  # a state this client cannot take is ignored, not fatal
        conn.load_uplink_state_dict({})
        log.error(
            "client state %s does not fit this client, ignoring it (%s: %s)", path, type(exc).__name__, exc
        )
        return False
    log.info(
        "restored client state of round %s from %s (uplink codecs: %s)",
        saved.get("round"),
        path,
        ", ".join(saved["uplink"]) or "none",
    )
    return True
