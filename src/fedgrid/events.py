"""Structured coordinator events: what a round is doing, as data rather than log text.

A coordinator emits one ``Event`` at each step of a round that a script, a dashboard or a
fault-injection test may want to act on. ``fedgrid coordinator`` appends them to
``RUN_DIR/events.jsonl``, one JSON object a line (``{"t": UNIX_S, "event": NAME, ...}``),
flushed at once; a restarted coordinator appends to the same file. In-process code
subscribes a callback instead. Log messages may be reworded at any time; the events and
their fields below are a contract.

| event | fields | when |
|---|---|---|
| ``started`` | ``run_id``, ``address``, ``threads`` | the server listens |
| ``resumed`` | ``round`` (the last committed round) | state was loaded from ``--state-dir`` |
| ``client_joined`` | ``client``, ``name``, ``region`` | a Join was accepted |
| ``client_dropped`` | ``client``, ``reason`` | a client went silent and left the membership |
| ``identity_conflict`` | ``client`` (the replaced session), ``name``, ``by`` (the session that replaced it) | a session replaced by a newer Join of its identity called again: two processes hold the identity |
| ``round_opened`` | ``round``, ``task``, ``clients``, ``evaluate`` | tasks are ready for the assigned clients |
| ``updates_restored`` | ``round``, ``count`` | updates spilled before a restart count again |
| ``update_accepted`` | ``round``, ``client``, ``evaluate``, ``accepted``, ``expected`` | an upload was verified and kept |
| ``upload_broken`` | ``round``, ``client``, ``chunks`` | an upload stream broke; kept for resume |
| ``round_closed`` | ``round``, ``evaluate``, ``reason``, ``results``, ``failures``; at a quorum: ``after_quorum_s``, ``waiting`` (client ids) | no more uploads are taken (but for the ``waiting`` clients' late results) |
| ``late_refused`` | ``round`` (its task's), ``client``, ``reason`` | a late result was too stale to merge (``max_staleness``) |
| ``update_refused`` | ``round``, ``client``, ``name``, then ``distance``, ``median``, ``ratio``, or ``cosine``, ``deviation``, ``spread`` | an update was farther than ``max_update_ratio`` x the round's median distance, or pointed away from the round's coordinate-wise median update (its ``cosine`` with it under ``min_update_cosine``) or lay farther from it (``deviation``) than ``max_deviation_ratio`` x the fresh updates' median distance from it (``spread``): its client's failure (``server/influence.py``) |
| ``claim_capped`` | ``round``, ``client``, ``name``, ``claimed``, ``cap`` | a claim counts as its cap (``max_weight_ratio``, ``client_quotas``, ``max_weight_share``) |
| ``aggregating`` | ``round``, ``updates``, ``failures`` | the strategy aggregates |
| ``merged`` | ``round``, ``results``: one ``{client, name, task_round, staleness, num_examples, weight}`` per result, in merge order | a semi-asynchronous round's merge: exactly what entered it (``fedgrid simulate --replay`` replays it) |
| ``checkpoint_writing`` | ``round`` | the checkpoint of the round is being written |
| ``checkpoint_written`` | ``round`` | it is durable |
| ``round_committed`` | ``round`` | checkpoint, history and metrics hold the round |
| ``evaluating`` | ``round`` | the server-side evaluation of the round's model began (a coordinator's runs beside the next round: ``server/evaluation.py``) |
| ``evaluated`` | ``round``, ``loss``, ``seconds`` | its figures are in the round's row of ``metrics.jsonl`` (rewritten with them) |
| ``round_failed`` | ``round``, ``reason`` | the round's aggregate was not finite: the previous model stays, no checkpoint is written, history and metrics hold the round (``round_failed: 1``) |
| ``privacy_budget_reached`` | ``round`` (the round not run), ``reason`` (its epsilon, ``dp_epsilon`` and ``dp_delta``) | the round would have spent more than the DP budget: the run ends after the round before it (``server/privacy.py``) |
| ``stopped`` | ``committed`` (rounds) | a graceful stop (SIGTERM) ended the run early |
| ``finished`` | ``rounds`` | the run is complete and the model written |

``round_closed``'s ``reason`` is one of ``all`` (every assigned client reported or
failed), ``target`` (enough reported: over-selection), ``quorum`` (``min_quorum``
reported and ``grace_s`` passed; the others keep their task), ``deadline`` (the round timeout
passed with clients still pending) or ``stopping`` (the coordinator is shutting down).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["Event", "EventLog", "CLOSE_REASONS", "read_events"]

log = logging.getLogger(__name__)

#: Values of ``round_closed``'s ``reason``.
CLOSE_REASONS = ("all", "target", "quorum", "deadline", "stopping")


@dataclass(frozen=True)
class Event:
    """One event: its name, when (Unix seconds) and its fields."""

    event: str
    t: float
    fields: Mapping[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def to_json(self) -> str:
        # json.dumps escapes control characters, so client-supplied names cannot forge lines.
        return json.dumps({"t": round(self.t, 6), "event": self.event, **self.fields}, ensure_ascii=True)


class EventLog:
    """Where a coordinator's events go: an optional JSON-lines file and in-process subscribers.

    Args:
        path: file to append events to (``None``: none).

    A subscriber or a write that fails is logged and dropped; the run goes on, since events
    report on the run and must never stop it.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._lock = threading.Lock()
        self._subscribers: list[Callable[[Event], None]] = []
        self._file = open(path, "a", encoding="ascii") if path is not None else None
        if self._file is not None and self._file.tell() > 0:
            with open(path, "rb") as f:  # type: ignore[arg-type]
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
            if torn:  # a process killed mid-write left half a line: end it, so the next event stands alone
                self._file.write("\n")
                self._file.flush()

    def subscribe(self, callback: Callable[[Event], None]) -> None:
        """Calls ``callback(event)`` for every later event, on the emitting thread."""
        with self._lock:
            self._subscribers.append(callback)

    def emit(self, event: str, **fields: Any) -> None:
        """Records ``event`` with ``fields`` (JSON-serializable scalars)."""
        e = Event(event, time.time(), fields)
        with self._lock:  # one order for the file and the subscribers
            if self._file is not None:
                try:
                    self._file.write(e.to_json() + "\n")
                    self._file.flush()
                except (OSError, ValueError) as exc:
                    log.warning("events: cannot write %s: %s", event, exc)
            for callback in list(self._subscribers):
                try:
                    callback(e)
                except Exception:  # noqa: BLE001 - a broken observer must not break the round
                    log.exception("events: subscriber failed on %s", event)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: str | os.PathLike[str]) -> list[Event]:
    """The events of an ``events.jsonl`` file, in order (a torn last line is left out)."""
    out = []
    with open(path, encoding="ascii") as f:
        for line in f:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            out.append(Event(obj.pop("event"), obj.pop("t"), obj))
    return out
