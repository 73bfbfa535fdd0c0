"""Membership of a run: who joined, their session tokens, who is alive, who is benched
(``Membership``, the coordinator's table of its clients).

It lives under the fleet's one state lock and wakes waiters through the fleet's
``Wakeups`` (key ``"membership"`` for joins and leaves). Removing a client calls
``on_remove`` (lock held) so that the open round fails the client's task at once.

Session tokens are kept only as SHA-256 hashes (``ClientRecord.token_hash``), in memory and
in ``state_dict`` (so in checkpoints): a leaked checkpoint holds no usable session. A token
is 24 random bytes, so an unsalted fast hash is enough (nothing to brute-force); presented
tokens are compared by hash with ``hmac.compare_digest``. A restored coordinator still
authenticates the sessions clients hold.

A Join is checked before it touches state: name (at most ``MAX_NAME_CHARS``), region
(``MAX_REGION_CHARS``) and codec names (``MAX_LABEL_CHARS``, at most ``protocol.MAX_CODECS``) are
printable text (``fedgrid.textsafe.check_label``); the device is a device type and the
accelerator count and memory are within ``fedgrid.capabilities``' bounds
(``check_capabilities``); ``num_examples`` is within ``UpdateBounds.max_num_examples``. The
checks are ``fleet/protocol.py``'s ``check_joining``, which the simulated fleet calls too.
Client text is logged through ``escape``.

One identity (a name; under mutual TLS the certificate's) has one session. The newest Join
always takes its place, so a client restarted after a crash takes over its session at once,
without waiting for the old one to fall silent. The replaced session is remembered (its id
and token hash, the latest ``MAX_REPLACED``): a call that presents it later proves that its
process is still running, so two processes hold one identity (the same ``--partition``, or
the same certificate). That call is refused with ``SessionReplacedError``, whose reason the
SDK recognises (it stops with one line instead of joining again and replacing the other in
turn), and the conflict is counted (``conflicts``; the coordinator's waiting line shows it).
A crashed process never calls again, so a restart is never counted; a replaced session's
long poll still in flight is answered at once with "poll again", so that only a new call
counts.

Sessions do not pile up. A session silent for ``SILENCE_INTERVALS`` heartbeat intervals
(holding no long poll and no transfer) is purged, by ``live`` and at least once a heartbeat
interval by ``join``; the membership holds at most ``max_sessions`` (``MAX_SESSIONS``), and a Join
past it, once the silent ones are purged, is refused (``ResourceLimitError``) unless it
replaces a session of its own name. Joins and drops are logged one line each up to
``LOG_BURST_LINES`` per ``LOG_SUMMARY_S``, then in a summary line (``server/log_budget.py``):
20,000 anonymous Joins cost a few lines, not 20,000.

A session token identifies its session (``session``): the transfer handlers check it from
the call's metadata before a transfer takes a slot (``server/slots.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import secrets
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from fedgrid.constants import MAX_SESSIONS
from fedgrid.errors import (
    AuthenticationError,
    PermissionDeniedError,
    ResourceLimitError,
    SessionReplacedError,
)
from fedgrid.events import EventLog
from fedgrid.fleet.bounds import UpdateBounds
from fedgrid.fleet.protocol import check_joining
from fedgrid.server.log_budget import LogBudget
from fedgrid.server.peers import CALLER
from fedgrid.server.wakeups import Wakeups
from fedgrid.textsafe import escape
from fedgrid.types import ClientInfo

__all__ = [
    "ClientRecord",
    "Membership",
    "SILENCE_INTERVALS",
    "MAX_REPLACED",
    "token_hash",
]

log = logging.getLogger(__name__)

#: A client silent for this many heartbeat intervals is considered gone.
SILENCE_INTERVALS = 3.0
#: Replaced sessions remembered, so that a process still using one is told (the oldest go first).
MAX_REPLACED = 1024


def token_hash(token: str) -> str:
    """SHA-256 hex digest of a session token: what the membership keeps instead of the token."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass
class ClientRecord:
    info: ClientInfo
    token_hash: str  # SHA-256 hex of the session token; the token itself is never kept
    last_seen: float
    heard_finished: bool = False
    #: The task whose deadline it missed while alive: not selected until it shows it finished
    #: that task (an upload or a failure report for it). Empty: selectable.
    benched_task: str = ""
    polls: int = 0  # long polls it holds now
    transfers: int = 0  # model downloads and uploads it has in flight (its heartbeats may wait behind them)
    #: Its running task's progress, as its last heartbeat reported it (``server/progress.py``); None: none.
    progress: dict[str, float | int] | None = None


@dataclass
class _Replaced:
    """A session a newer Join of the same identity replaced (module docstring)."""

    name: str
    token_hash: str
    by: str  # the client id of the session that took its place
    told: bool = False  # a call of it was refused: its conflict is counted


class Membership:
    """The clients of a run, by client id.

    Args:
        wake: the fleet's wake-ups (their lock is the state lock every method takes).
        events: where joins, leaves and drops are reported.
        heartbeat_interval_s: silence for ``SILENCE_INTERVALS`` of these drops a client
            (unless it holds a long poll: its connection is watched by keepalive pings),
            measured on ``wake``'s clock.
        on_remove: called with the record and the reason when a client is removed (lock held).
        bounds: what a Join may report (``num_examples``).
        max_sessions: sessions held at once (module docstring).
    """

    def __init__(
        self,
        wake: Wakeups,
        events: EventLog,
        heartbeat_interval_s: float,
        on_remove: Callable[[ClientRecord, str], None],
        bounds: UpdateBounds | None = None,
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self.bounds = bounds if bounds is not None else UpdateBounds()
        self.wake = wake
        self.lock = wake.lock
        self.clock = wake.clock  # the fleet's: last_seen, silence and purges are in its time
        self.events = events
        self.heartbeat_interval_s = heartbeat_interval_s
        self.on_remove = on_remove
        self.records: dict[str, ClientRecord] = {}
        self._by_name: dict[str, str] = {}  # name -> client id: a rejoin finds its ghost in O(1)
        self._replaced: OrderedDict[str, _Replaced] = OrderedDict()  # client id -> its replacement
        #: Identity conflicts by name: replaced sessions whose process called again.
        self.conflicts: dict[str, int] = {}
        self._by_token: dict[str, str] = {}  # token hash -> client id: a session from metadata alone
        self._next_purge = 0.0  # join purges silent sessions at most once a heartbeat interval
        self._join_log = LogBudget(log, "clients joined", clock=self.clock.now)
        self._drop_log = LogBudget(log, "silent clients dropped", clock=self.clock.now)

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
            InvalidUpdateError: the Join breaks a rule of ``check_joining`` (nothing changed).
        """
        if identity is not None:
            if joining.name and joining.name != identity:
                raise PermissionDeniedError(
                    f"the certificate of {identity!r} cannot join as {escape(joining.name)}"
                )
            joining = dataclasses.replace(joining, name=identity)
        check_joining(joining, self.bounds)
        info = dataclasses.replace(joining, client_id=uuid.uuid4().hex[:16])
        token = secrets.token_urlsafe(24)
        with self.lock:
            # A restarted client rejoins under its name: its old session goes, no ghost stays.
            ghost = self._by_name.get(info.name) if info.name else None
            ghosts = [ghost] if ghost is not None and ghost in self.records else []
            if not ghosts:
                self._make_room()
            for cid in ghosts:
                ghost_token = self.records[cid].token_hash
                self._remember_replaced(self.records[cid], by=info.client_id)
                self.remove(cid, "replaced by a new session of the same name")
                self._by_token[ghost_token] = cid  # its late calls hear why (``session``)
            self.records[info.client_id] = ClientRecord(info, token_hash(token), self.clock.now())
            self._by_token[self.records[info.client_id].token_hash] = info.client_id
            if info.name:
                self._by_name[info.name] = info.client_id
            # A replaced session's long poll ends now ("poll again"): only a new call tells.
            self.wake.notify("membership", *(("poll", cid) for cid in ghosts))
        for cid in ghosts:
            self._join_log.log(
                logging.INFO, "client %s rejoined: session %s replaced", escape(info.name), cid
            )
            self.events.emit("client_left", client=cid, reason="replaced by a new session of the same name")
        self._join_log.log(
            logging.INFO,
            "client %s joined as %s (region %s, %d examples)",
            escape(info.name),
            info.client_id,
            escape(info.region),
            info.num_examples,
        )
        self.events.emit("client_joined", client=info.client_id, name=info.name, region=info.region)
        return info, token

    def _make_room(self) -> None:
        """Purges silent sessions once a heartbeat interval, or now when the membership is full;
        refuses a new session past ``max_sessions`` (lock held).

        Raises:
            ResourceLimitError: ``max_sessions`` sessions, none of them silent.
        """
        now = self.clock.now()
        if now >= self._next_purge or len(self.records) >= self.max_sessions:
            self.purge()
            self._next_purge = now + self.heartbeat_interval_s
        if len(self.records) >= self.max_sessions:
            raise ResourceLimitError(
                f"coordinator full: {len(self.records)} sessions (limit {self.max_sessions}); retry later"
            )

    def session(self, token: str) -> ClientRecord:
        """The record of the session ``token`` names, marked alive (``authenticate``'s checks).

        Raises:
            AuthenticationError: no token, or one of no session (``SessionReplacedError``: of
                a session a newer Join of its identity replaced).
            PermissionDeniedError: the session is another identity's.
        """
        if not token:
            raise AuthenticationError("no session token: Join first, then send it as call metadata")
        with self.lock:
            client_id = self._by_token.get(token_hash(token))
        if client_id is None:
            raise AuthenticationError("bad session token: it names no session (Join again)")
        return self.authenticate(client_id, token)

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
                self._check_replaced(client_id, token, caller.identity if caller is not None else None)
                raise AuthenticationError(f"unknown client {escape(client_id)}")
            if not hmac.compare_digest(token_hash(token), record.token_hash):
                raise AuthenticationError(f"bad session token for client {escape(client_id)}")
            if caller is not None and caller.identity is not None and caller.identity != record.info.name:
                raise PermissionDeniedError(
                    f"the certificate of {caller.identity!r} cannot act as client {escape(client_id)} ({escape(record.info.name)})"
                )
            record.last_seen = self.clock.now()
            return record

    def _remember_replaced(self, record: ClientRecord, *, by: str) -> None:
        """Keeps ``record``'s session as replaced by ``by`` (lock held)."""
        self._replaced[record.info.client_id] = _Replaced(record.info.name, record.token_hash, by)
        while len(self._replaced) > MAX_REPLACED:
            cid, old = self._replaced.popitem(last=False)
            if self._by_token.get(old.token_hash) == cid:
                del self._by_token[old.token_hash]

    def _check_replaced(self, client_id: str, token: str, identity: str | None) -> None:
        """Raises ``SessionReplacedError`` when ``client_id`` is a replaced session presented
        with its own token (and, under mTLS, by its identity); counts the conflict at its
        first call (lock held). Otherwise returns: the session is simply unknown."""
        replaced = self._replaced.get(client_id)
        if replaced is None or not hmac.compare_digest(token_hash(token), replaced.token_hash):
            return
        if identity is not None and identity != replaced.name:
            return
        name = escape(replaced.name)
        if not replaced.told:
            replaced.told = True
            self.conflicts[replaced.name] = self.conflicts.get(replaced.name, 0) + 1
            log.warning(
                "identity conflict: %s is held by two processes (session %s was replaced by %s and still "
                "calls): two clients with the same --partition or certificate? The older one is told to stop",
                name,
                client_id,
                replaced.by,
            )
            self.events.emit("identity_conflict", client=client_id, name=replaced.name, by=replaced.by)
            self.wake.notify("membership")  # a waiting coordinator says so now
        raise SessionReplacedError(
            f"session {client_id} of {name} was replaced by a newer session of the same identity "
            f"({replaced.by}) while this process still runs: two processes hold {name} "
            "(the same --partition, or the same certificate)"
        )

    def conflict_note(self) -> str:
        """The waiting line's words for the identity conflicts so far ("" for none; lock held)."""
        if not self.conflicts:
            return ""
        total = sum(self.conflicts.values())
        names = ", ".join(escape(n) for n in sorted(self.conflicts)[:3]) + (
            ", ..." if len(self.conflicts) > 3 else ""
        )
        return (
            f", {total} identity conflict{'s' if total != 1 else ''} ({names}: two processes with one "
            "--partition or certificate)"
        )

    def remove(self, client_id: str, reason: str) -> None:
        """Drops a client, failing its open task (lock held)."""
        record = self.records.pop(client_id)
        self._unindex(record)
        self.on_remove(record, reason)

    def _unindex(self, record: ClientRecord) -> None:
        if self._by_name.get(record.info.name) == record.info.client_id:
            del self._by_name[record.info.name]
        if self._by_token.get(record.token_hash) == record.info.client_id:
            del self._by_token[record.token_hash]

    def live(self) -> list[ClientInfo]:
        """Every client heard from lately; the silent ones are dropped here (lock held)."""
        self.purge()
        return [rec.info for rec in self.records.values()]

    def purge(self) -> int:
        """Drops the sessions silent for ``SILENCE_INTERVALS`` heartbeat intervals that hold no
        long poll and no transfer; returns how many (lock held)."""
        now = self.clock.now()
        limit = SILENCE_INTERVALS * self.heartbeat_interval_s
        # A client in a long poll or a transfer is alive: over a saturated link its heartbeats
        # wait behind its own download or upload on the one connection.
        gone = [
            cid
            for cid, rec in self.records.items()
            if now - rec.last_seen > limit and rec.polls == 0 and rec.transfers == 0
        ]
        for cid in gone:
            self._drop_log.log(
                logging.WARNING,
                "client %s silent for over %.1fs: dropped",
                escape(self.records[cid].info.name or cid),
                limit,
            )
            self._unindex(self.records.pop(cid))
            self.events.emit("client_dropped", client=cid, reason=f"silent for over {limit:.1f}s")
        self._join_log.flush()
        self._drop_log.flush()
        return len(gone)

    def state_dict(self) -> list[dict[str, Any]]:
        """Each client's info, token hash and benched task: plain JSON values, no token."""
        with self.lock:
            return [
                {**dataclasses.asdict(r.info), "token_sha256": r.token_hash, "benched_task": r.benched_task}
                for r in self.records.values()
            ]

    def load_state_dict(self, entries: list[Mapping[str, Any]], *, seen_at: float) -> None:
        """Restores the clients with their sessions, as last seen at ``seen_at`` (the clock's time)."""
        with self.lock:
            self.records = {}
            self._by_name = {}
            self._by_token = {}
            for entry in entries:
                fields = {k: v for k, v in entry.items() if k not in ("token_sha256", "benched_task")}
                info = ClientInfo(**{**fields, "codecs": tuple(fields.get("codecs", ("none",)))})
                self.records[info.client_id] = ClientRecord(
                    info, str(entry["token_sha256"]), seen_at, benched_task=str(entry.get("benched_task", ""))
                )
                self._by_token[str(entry["token_sha256"])] = info.client_id
                if info.name:
                    self._by_name[info.name] = info.client_id
