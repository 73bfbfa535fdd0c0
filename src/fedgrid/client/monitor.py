"""A client's ``/metrics`` and ``/api/status``: what ``fedgrid client --http HOST:PORT`` serves.

Fed by ``run``'s ``on_task`` (one ``TaskReport`` per finished task) and ``on_event`` (one
``ClientEvent`` per change of the session), in a registry of its own (never
prometheus-client's global one), served read-only by ``fedgrid.webserve`` under the same
rules as the coordinator's (loopback, or a bearer token from ``--http-token-file``):

| metric | labels | what |
|---|---|---|
| ``fedgrid_client_rounds_trained_total`` | | fit tasks trained and uploaded |
| ``fedgrid_client_tasks_total`` | ``kind`` (``fit``, ``evaluate``) | tasks finished |
| ``fedgrid_client_examples_total`` | ``kind`` | examples the results claimed |
| ``fedgrid_client_last_loss`` | | the latest fit result's loss (NaN before one) |
| ``fedgrid_client_last_round`` | | the round of the latest task |
| ``fedgrid_client_bytes_total`` | ``direction`` (``up``, ``down``) | wire bytes of uploads (every try) and downloads |
| ``fedgrid_client_upload_retries_total`` | | upload tries after the first |

``/api/status`` is one JSON object of fixed size (no list grows with the run; see
``ClientMonitor.status``). Text that did not come from this process's own configuration
(error messages, which may quote the coordinator or the application) is escaped with
``fedgrid.textsafe.escape`` and cut to ``ESCAPE_LIMIT`` characters; the name and the
coordinator's address are too when they hold anything a label may not.
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any

from fedgrid.client.runtime import ClientEvent, TaskReport
from fedgrid.textsafe import ESCAPE_LIMIT, MAX_NAME_CHARS, escape
from fedgrid.webserve import Response, Route, StatusServer, require_prometheus

__all__ = ["ClientMonitor", "serve_client_metrics", "STATES"]

#: ``/api/status``'s ``state``: before the join, waiting for a task, busy with one (its kind),
#: and the three ends.
STATES = ("connecting", "idle", "fit", "evaluate", "message", "finished", "stopped", "failed")


def _label(text: str, limit: int) -> str:
    """``text`` itself when it is at most ``limit`` printable characters, else escaped and cut."""
    return text if len(text) <= limit and text.isprintable() else escape(text, limit)


class ClientMonitor:
    """The metrics and status of one client.

    Args:
        name: the client's name, shown in ``/api/status``.
        coordinator: the address it joins, shown in ``/api/status``.

    Raises:
        ConfigError: ``prometheus-client`` is not installed (the message names the extra).
    """

    def __init__(self, *, name: str = "", coordinator: str = "") -> None:
        prom = require_prometheus()
        self.registry = r = prom.CollectorRegistry(auto_describe=True)
        self.rounds = prom.Counter(
            "fedgrid_client_rounds_trained", "fit tasks trained and uploaded", registry=r
        )
        self.tasks = prom.Counter("fedgrid_client_tasks", "tasks finished", ["kind"], registry=r)
        self.examples = prom.Counter(
            "fedgrid_client_examples", "examples the results claimed", ["kind"], registry=r
        )
        self.last_loss = prom.Gauge("fedgrid_client_last_loss", "the latest fit result's loss", registry=r)
        self.last_loss.set(float("nan"))
        self.last_round = prom.Gauge("fedgrid_client_last_round", "the round of the latest task", registry=r)
        self.bytes = prom.Counter("fedgrid_client_bytes", "wire bytes moved", ["direction"], registry=r)
        self.retries = prom.Counter(
            "fedgrid_client_upload_retries", "upload tries after the first", registry=r
        )
        for kind in ("fit", "evaluate"):
            self.tasks.labels(kind=kind)
            self.examples.labels(kind=kind)
        for direction in ("up", "down"):
            self.bytes.labels(direction=direction)
        self._generate, self._content_type = prom.generate_latest, prom.CONTENT_TYPE_LATEST
        # What /api/status shows, written by the client's thread and read by the server's.
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._view: dict[str, Any] = {
            "name": _label(name, MAX_NAME_CHARS),
            "coordinator": _label(coordinator, ESCAPE_LIMIT),
            "client_id": "",
            "run_id": "",
            "state": "connecting",
            "joined": False,
            "joins": 0,
            "round": 0,
            "task": None,
            "rounds_trained": 0,
            "tasks": {"fit": 0, "evaluate": 0},
            "last_loss": None,
            "bytes_up": 0,
            "bytes_down": 0,
            "upload_retries": 0,
            "last_error": None,
            "last_error_round": None,
        }

    def on_task(self, report: TaskReport) -> None:
        """``run``'s ``on_task``."""
        kind = "evaluate" if report.kind == "evaluate" else "fit"
        self.tasks.labels(kind=kind).inc()
        self.examples.labels(kind=kind).inc(max(0, report.num_examples))
        if kind == "fit":
            self.rounds.inc()
            if report.loss is not None:
                self.last_loss.set(report.loss)
        self.last_round.set(report.round)
        self.bytes.labels(direction="up").inc(report.bytes_up)
        self.bytes.labels(direction="down").inc(report.bytes_down)
        self.retries.inc(report.upload_retries)
        with self._lock:
            v = self._view
            v["tasks"] = {**v["tasks"], kind: v["tasks"][kind] + 1}
            if kind == "fit":
                v["rounds_trained"] += 1
                if report.loss is not None and math.isfinite(report.loss):  # JSON has no NaN
                    v["last_loss"] = report.loss
            v["bytes_up"] += report.bytes_up
            v["bytes_down"] += report.bytes_down
            v["upload_retries"] += report.upload_retries

    def on_event(self, event: ClientEvent) -> None:
        """``run``'s ``on_event``."""
        with self._lock:
            v = self._view
            if event.kind == "joined":
                v.update(
                    client_id=_label(event.client_id, ESCAPE_LIMIT),
                    run_id=_label(event.run_id, ESCAPE_LIMIT),
                    joined=True,
                    joins=v["joins"] + 1,
                    state="idle",
                    task=None,
                )
            elif event.kind == "polling":
                v.update(state="idle", task=None)
            elif event.kind == "task":
                v.update(state=event.task, task=event.task, round=event.round)
            elif event.kind == "error":
                v.update(last_error=escape(event.detail), last_error_round=event.round)
            elif event.kind in ("finished", "left"):
                # Stopped on purpose (``stop``, Ctrl-C, SIGTERM) or not: ``detail`` is the exception.
                failed = event.kind == "left" and not (
                    event.detail == "stopped" or event.detail.startswith("KeyboardInterrupt")
                )
                v.update(
                    state="finished" if event.kind == "finished" else "failed" if failed else "stopped",
                    joined=False,
                    task=None,
                )
                if failed:
                    v.update(last_error=escape(event.detail), last_error_round=None)

    def status(self) -> dict[str, Any]:
        """What ``/api/status`` serves.

        Returns:
            ``name``, ``coordinator``, ``client_id`` and ``run_id`` (empty before the join),
            ``state`` (one of ``STATES``), ``joined`` (a session is open), ``joins``
            (sessions opened: more than 1 after the coordinator lost this one),
            ``round`` (of the current or latest task; 0 before one) and ``task`` (the
            current task's kind, ``null`` when none), ``rounds_trained``, ``tasks``
            (finished, by kind), ``last_loss`` (``null`` before a fit), ``bytes_up`` and
            ``bytes_down`` (wire bytes of finished tasks), ``upload_retries``,
            ``last_error`` (escaped; ``null`` if none) and ``last_error_round``,
            ``uptime_s`` (since this monitor started) and ``time`` (Unix seconds).
        """
        with self._lock:
            view = {**self._view, "tasks": dict(self._view["tasks"])}
        return {**view, "uptime_s": round(time.monotonic() - self._started, 3), "time": round(time.time(), 3)}

    def routes(self) -> dict[str, Route]:
        """``/metrics`` and ``/api/status``, both behind the bearer token when there is one."""
        return {
            "/metrics": Route(
                lambda: Response(self._generate(self.registry), content_type=self._content_type)
            ),
            "/api/status": Route(
                lambda: Response(
                    json.dumps(self.status(), ensure_ascii=True, allow_nan=False).encode(),
                    content_type="application/json",
                )
            ),
        }


def serve_client_metrics(
    address: str, *, token_file: str = "", name: str = "", coordinator: str = ""
) -> tuple[ClientMonitor, StatusServer]:
    """A started ``StatusServer`` on ``address`` serving a new ``ClientMonitor``'s ``/metrics``
    and ``/api/status`` (``name`` and ``coordinator`` as ``ClientMonitor`` takes them).

    Raises:
        ConfigError: no prometheus-client, a bad address, or a non-loopback host without a token.
    """
    monitor = ClientMonitor(name=name, coordinator=coordinator)
    return monitor, StatusServer(address, monitor.routes(), token_file=token_file, key="http").start()
