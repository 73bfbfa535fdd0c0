"""The client registry: who joined, their session tokens, who is alive, who is benched.

It lives under the fleet's one state lock and wakes waiters through the fleet's
``Wakeups`` (key ``"registry"`` for joins and leaves). Removing a client calls
``on_remove`` (lock held) so that the open round fails the client's task at once.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from fedgrid.errors import AuthenticationError, PermissionDeniedError
from fedgrid.events import EventLog
from fedgrid.server.peers import CALLER
from fedgrid.server.wakeups import Wakeups
from fedgrid.types import ClientInfo

__all__ = ["ClientRecord", "Registry", "SILENCE_INTERVALS"]

log = logging.getLogger(__name__)

#: A client silent for this many heartbeat intervals is considered gone.
SILENCE_INTERVALS = 3.0


@dataclass
class ClientRecord:
    info: ClientInfo
    token: str
    last_seen: float
    heard_finished: bool = False
    #: The task whose deadline it missed while alive: not selected until it shows it finished
    #: that task (an upload or a failure report for it). Empty: selectable.
    benched_task: str = ""
    polls: int = 0  # long polls it holds now


class Registry:
    """The clients of a run, by client id.

    Args:
        wake: the fleet's wake-ups (their lock is the state lock every method takes).
        events: where joins, leaves and drops are reported.
        heartbeat_interval_s: silence for ``SILENCE_INTERVALS`` of these drops a client
            (unless it holds a long poll: its connection is watched by keepalive pings).
        on_remove: called with the record and the reason when a client is removed (lock held).
    """

    def __init__(self, wake: Wakeups, events: EventLog, heartbeat_interval_s: float,
                 on_remove: Callable[[ClientRecord, str], None]) -> None:
        self.wake = wake
        self.lock = wake.lock
        self.events = events
        self.heartbeat_interval_s = heartbeat_interval_s
        self.on_remove = on_remove
        self.records: dict[str, ClientRecord] = {}
        self._by_name: dict[str, str] = {}  # name -> client id: a rejoin finds its ghost in O(1)

    def join(self, joining: ClientInfo, *, identity: str | None = None) -> tuple[ClientInfo, str]:
        """Registers a client under a new id; a session of the same name is replaced.

        Under mutual TLS ``identity`` is the client's certificate identity, and it is the
        client's name: the key of the name index (so one identity has one live session, a
        second join replacing the first), of the canonical aggregation order
        (``ClientInfo.sort_key``) and of its state file. The client id stays a per-session
        handle, so a replaced session's late calls never pass for the new one's. A join that
        names another name is refused.

        Raises:
            PermissionDeniedError: the request's name is not the certificate's identity.
        """
        if identity is not None:
            if joining.name and joining.name != identity:
                raise PermissionDeniedError(f"the certificate of {identity!r} cannot join as {joining.name[:128]!r}")
            joining = dataclasses.replace(joining, name=identity)
        info = dataclasses.replace(joining, client_id=uuid.uuid4().hex[:16])
        token = secrets.token_urlsafe(24)
        with self.lock:
            # A restarted client rejoins under its name: its old session goes, no ghost stays.
            ghost = self._by_name.get(info.name) if info.name else None
            ghosts = [ghost] if ghost is not None and ghost in self.records else []
            for cid in ghosts:
                self.remove(cid, "replaced by a new session of the same name")
            self.records[info.client_id] = ClientRecord(info, token, time.monotonic())
            if info.name:
                self._by_name[info.name] = info.client_id
            self.wake.notify("registry")
        for cid in ghosts:
            log.info("client %r rejoined: session %s replaced", info.name, cid)
            self.events.emit("client_left", client=cid, reason="replaced by a new session of the same name")
        log.info("client %r joined as %s (region %r, %d examples)", info.name, info.client_id, info.region, info.num_examples)
        self.events.emit("client_joined", client=info.client_id, name=info.name, region=info.region)
        return info, token

    def authenticate(self, client_id: str, token: str) -> ClientRecord:
        """Returns the client's record and marks it alive.

        Under mutual TLS the calling peer (``CALLER``, set by the service's guard) must be
        the identity the session joined as.

        Raises:
            AuthenticationError: unknown client or wrong token.
            PermissionDeniedError: the session is another identity's.
        """
        caller = CALLER.get(None)
        with self.lock:
            record = self.records.get(client_id)
            if record is None:
                raise AuthenticationError(f"unknown client {client_id[:64]!r}")
            if not secrets.compare_digest(record.token.encode(), token.encode()):
                raise AuthenticationError(f"bad session token for client {client_id[:64]!r}")
            if caller is not None and caller.identity is not None and caller.identity != record.info.name:
                raise PermissionDeniedError(f"the certificate of {caller.identity!r} cannot act as client {client_id!r} ({record.info.name!r})")
            record.last_seen = time.monotonic()
            return record

    def remove(self, client_id: str, reason: str) -> None:
        """Drops a client, failing its open task (lock held)."""
        record = self.records.pop(client_id)
        self._unindex(record)
        self.on_remove(record, reason)

    def _unindex(self, record: ClientRecord) -> None:
        if self._by_name.get(record.info.name) == record.info.client_id:
            del self._by_name[record.info.name]

    def live(self) -> list[ClientInfo]:
        """Every client heard from lately; the silent ones are dropped here (lock held)."""
        now = time.monotonic()
        limit = SILENCE_INTERVALS * self.heartbeat_interval_s
        gone = [cid for cid, rec in self.records.items() if now - rec.last_seen > limit and rec.polls == 0]
        for cid in gone:
            log.warning("client %r silent for over %.1fs: dropped", self.records[cid].info.name or cid, limit)
            self._unindex(self.records.pop(cid))
            self.events.emit("client_dropped", client=cid, reason=f"silent for over {limit:.1f}s")
        return [rec.info for rec in self.records.values()]

    def selectable(self) -> list[ClientInfo]:
        """The live clients not benched for a missed deadline (lock held)."""
        return [info for info in self.live() if not self.records[info.client_id].benched_task]

    def state_dict(self) -> list[dict[str, Any]]:
        with self.lock:
            return [{**dataclasses.asdict(r.info), "token": r.token, "benched_task": r.benched_task} for r in self.records.values()]

    def load_state_dict(self, entries: list[Mapping[str, Any]], *, seen_at: float) -> None:
        """Restores the clients with their sessions, as last seen at ``seen_at`` (monotonic)."""
        with self.lock:
            self.records = {}
            self._by_name = {}
            for entry in entries:
                fields = {k: v for k, v in entry.items() if k not in ("token", "benched_task")}
                info = ClientInfo(**{**fields, "codecs": tuple(fields.get("codecs", ("none",)))})
                self.records[info.client_id] = ClientRecord(info, str(entry["token"]), seen_at, benched_task=str(entry.get("benched_task", "")))
                if info.name:
                    self._by_name[info.name] = info.client_id
