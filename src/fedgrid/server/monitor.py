"""The coordinator's live view: Prometheus metrics, ``/api/status`` and the status page.

``CoordinatorMonitor`` is fed by what the coordinator already produces, not by metric calls
spread through the code: the event stream (``fedgrid.events``, subscribed), each round's
``RoundMetrics`` (the engine's ``on_round``), the fleet's state (read when asked) and a
``grpc.aio`` server interceptor timing every RPC. ``fedgrid coordinator --http HOST:PORT``
serves it (``start_monitoring``) with ``fedgrid.webserve``.

Metrics (one ``CollectorRegistry`` per coordinator, never the global one):

| metric | labels | what |
|---|---|---|
| ``fedgrid_rounds_committed_total`` | | rounds committed (checkpoint, history and metrics hold them) |
| ``fedgrid_rounds_failed_total`` | | rounds whose aggregate was not finite |
| ``fedgrid_round`` | | the round in progress, else the last one run |
| ``fedgrid_live_clients`` | | clients in the membership |
| ``fedgrid_clients_joined_total`` | | Joins accepted |
| ``fedgrid_clients_gone_total`` | ``reason`` (``left``, ``dropped``, ``replaced``) | clients that left the membership |
| ``fedgrid_updates_accepted_total`` | ``phase`` | uploads verified and kept |
| ``fedgrid_client_failures_total`` | ``phase``, ``reason`` | failed client tasks, by ``FAILURE_REASONS`` |
| ``fedgrid_client_results_total`` | ``outcome`` (``ok``, ``failed``) | fit results per round, as ``metrics.jsonl``'s ``clients_ok`` / ``clients_failed`` |
| ``fedgrid_bytes_total`` | ``direction`` (``up``, ``down``) | wire bytes of the rounds, as ``metrics.jsonl``'s ``bytes_up`` / ``bytes_down`` |
| ``fedgrid_phase_duration_seconds`` | ``phase`` | histogram: a phase open to close (``fit``, ``evaluate``, message phases), ``aggregate``, ``checkpoint`` |
| ``fedgrid_round_duration_seconds`` | | histogram: a round's ``wall_s`` |
| ``fedgrid_rpc_duration_seconds`` | ``method``, ``code`` | histogram: a gRPC call's time in the servicer (long polls included) |
| ``fedgrid_task_seconds`` | ``part`` (``compute``, ``comm``, ``wait``), ``region`` | histogram: a fit result's split of its window (``fedgrid.client.timeline``) |
| ``fedgrid_task_utilization`` | ``region`` | histogram: a fit result's ``utilization`` (compute over its window's wall time) |

Label values are from fixed sets or server-side names (methods, phases the strategy
declares), so a client cannot grow the series without bound; the one exception is the
goodput histograms' ``region``: a region label a client joined with (printable, at most 64
characters, checked at Join), for the first ``MAX_REGION_LABELS`` distinct ones, ``other``
after them. No client name or id is ever a label. Failure reasons (client text among them)
are sorted into ``FAILURE_REASONS``.

``/api/status`` shows each client's last fit split (``compute_s``, ``comm_s``, ``wait_s``,
``wall_s``, ``utilization``) and, per region, the sums of its clients' last splits with their
utilization.

Beside it: the goodput histograms and the splits kept (``server/goodput_export.py``) and the
RPC timer (``server/rpc_timer.py``).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

from fedgrid.events import Event
from fedgrid.runlog import strict_json
from fedgrid.server.goodput_export import MAX_REGION_LABELS, SPLIT_FIELDS, GoodputExport, region_rows
from fedgrid.server.membership import SILENCE_INTERVALS
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.rpc_timer import RpcTimer
from fedgrid.server.status_page import page_response
from fedgrid.types import ClientInfo, FitRes, RoundMetrics
from fedgrid.webserve import Response, Route, require_prometheus

__all__ = [
    "CoordinatorMonitor",
    "RpcTimer",
    "failure_reason",
    "FAILURE_REASONS",
    "MAX_STATUS_CLIENTS",
    "MAX_REGION_LABELS",
]

#: The ``reason`` label of ``fedgrid_client_failures_total``: what a failure's text says, sorted.
FAILURE_REASONS = (
    "deadline",
    "silent",
    "stopping",
    "client_error",
    "left",
    "replaced",
    "no_examples",
    "other",
)
#: Clients listed in ``/api/status`` (the count of all is ``clients_total``).
MAX_STATUS_CLIENTS = 1000
#: Clients whose last fit split is kept (the most recent to report; ``/api/status`` also
#: forgets those that left the membership).
MAX_KEPT_SPLITS = 10 * MAX_STATUS_CLIENTS
_RPC_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, float("inf"))
_PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, float("inf"))


def failure_reason(text: str) -> str:
    """The ``FAILURE_REASONS`` label of a failure's text (``Failure.reason``)."""
    rules = (
        ("missed the round deadline", "deadline"),
        ("client went silent", "silent"),
        ("silent for", "silent"),
        ("coordinator stopping", "stopping"),
        ("client reported:", "client_error"),
        ("client left:", "left"),
        ("replaced by a new session", "replaced"),
        ("evaluated no examples", "no_examples"),
    )
    for prefix, label in rules:
        if text.startswith(prefix):
            return label
    return "other"


class CoordinatorMonitor:
    """Metrics and status of one coordinator.

    Args:
        fleet: the coordinator's fleet (clients and the open phase are read from it).
        rounds: the run's rounds.
        history: the committed rounds' metrics, read when asked (``RoundEngine.history``).

    Raises:
        ConfigError: ``prometheus-client`` is not installed (the message names the extra).
    """

    def __init__(
        self, fleet: RemoteFleet, *, rounds: int, history: Callable[[], Sequence[RoundMetrics]]
    ) -> None:
        prom = require_prometheus()
        self.fleet = fleet
        self.rounds = rounds
        self._history = history
        self._register_metrics(prom)
        self._generate_latest = prom.generate_latest
        self._content_type = prom.CONTENT_TYPE_LATEST
        self._lock = threading.Lock()  # this object's own state; never held while calling the fleet
        self.run_id = fleet.run_id
        self.state = "starting"  # starting, running, finished, stopped
        self.phase = "waiting"  # waiting (for clients), a phase name, aggregating, checkpointing
        self.current = 0
        self._opened: dict[str, float] = {}  # phase -> when it opened
        self._aggregating: float | None = None
        self._checkpointing: float | None = None

    def _register_metrics(self, prom: Any) -> None:
        """The collectors of the module's table, in this coordinator's own ``CollectorRegistry``."""
        self.registry = prom.CollectorRegistry(auto_describe=True)
        r = self.registry
        self.rounds_committed = prom.Counter("fedgrid_rounds_committed", "rounds committed", registry=r)
        self.rounds_failed = prom.Counter(
            "fedgrid_rounds_failed", "rounds whose aggregate was not finite", registry=r
        )
        self.round = prom.Gauge("fedgrid_round", "the round in progress, else the last one run", registry=r)
        self.live_clients = prom.Gauge("fedgrid_live_clients", "clients in the membership", registry=r)
        self.live_clients.set_function(self._client_count)
        self.joined = prom.Counter("fedgrid_clients_joined", "Joins accepted", registry=r)
        self.gone = prom.Counter(
            "fedgrid_clients_gone", "clients that left the membership", ["reason"], registry=r
        )
        self.accepted = prom.Counter(
            "fedgrid_updates_accepted", "uploads verified and kept", ["phase"], registry=r
        )
        self.failures = prom.Counter(
            "fedgrid_client_failures", "failed client tasks", ["phase", "reason"], registry=r
        )
        self.results = prom.Counter(
            "fedgrid_client_results", "fit results of the rounds run", ["outcome"], registry=r
        )
        self.bytes = prom.Counter("fedgrid_bytes", "wire bytes of the rounds run", ["direction"], registry=r)
        self.phase_seconds = prom.Histogram(
            "fedgrid_phase_duration_seconds",
            "time in a phase of a round",
            ["phase"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.round_seconds = prom.Histogram(
            "fedgrid_round_duration_seconds", "a round's wall time", buckets=_PHASE_BUCKETS, registry=r
        )
        self.rpc_seconds = prom.Histogram(
            "fedgrid_rpc_duration_seconds",
            "gRPC calls' time in the servicer",
            ["method", "code"],
            buckets=_RPC_BUCKETS,
            registry=r,
        )
        self.goodput = GoodputExport(prom, r, seconds_buckets=_PHASE_BUCKETS, keep=MAX_KEPT_SPLITS)
        for direction in ("up", "down"):
            self.bytes.labels(direction=direction)
        for outcome in ("ok", "failed"):
            self.results.labels(outcome=outcome)

    # -- feeds -----------------------------------------------------------------------------
    def on_event(self, e: Event) -> None:
        """Subscriber of the coordinator's ``EventLog`` (called on the emitting thread)."""
        handler = _EVENT_HANDLERS.get(e.event)
        with self._lock:
            self._end_aggregate(e.t)
            if handler is not None:
                handler(self, e)

    # The handlers of ``_EVENT_HANDLERS``, one per kind of event (called with the lock held).
    def _started(self, e: Event) -> None:
        self.state = "running"

    def _client_joined(self, e: Event) -> None:
        self.joined.inc()

    def _client_gone(self, e: Event) -> None:
        if e.event == "client_dropped":
            reason = "dropped"
        else:
            reason = "replaced" if str(e.get("reason", "")).startswith("replaced") else "left"
        self.gone.labels(reason=reason).inc()

    def _round_opened(self, e: Event) -> None:
        self.current = int(e["round"])
        self.round.set(self.current)
        self.phase = str(e.get("phase") or ("evaluate" if e.get("evaluate") else "fit"))
        self._opened[self.phase] = e.t

    def _update_accepted(self, e: Event) -> None:
        self.accepted.labels(phase="evaluate" if e.get("evaluate") else "fit").inc()

    def _messages_accepted(self, e: Event) -> None:
        self.accepted.labels(phase=str(e.get("phase", "message"))).inc()

    def _round_closed(self, e: Event) -> None:
        phase = str(e.get("phase") or ("evaluate" if e.get("evaluate") else "fit"))
        opened = self._opened.pop(phase, None)
        if opened is not None:
            self.phase_seconds.labels(phase=phase).observe(max(0.0, e.t - opened))
        self._count_failures(phase)
        if phase == "fit":
            self._observe_goodput()

    def _aggregating_started(self, e: Event) -> None:
        self.phase = "aggregating"
        self._aggregating = e.t

    def _checkpoint_writing(self, e: Event) -> None:
        self.phase = "checkpointing"
        self._checkpointing = e.t

    def _checkpoint_written(self, e: Event) -> None:
        if self._checkpointing is not None:
            self.phase_seconds.labels(phase="checkpoint").observe(max(0.0, e.t - self._checkpointing))
            self._checkpointing = None

    def _round_ended(self, e: Event) -> None:
        (self.rounds_committed if e.event == "round_committed" else self.rounds_failed).inc()
        self.phase = "waiting"

    def _run_ended(self, e: Event) -> None:
        self.state = e.event
        self.phase = e.event

    def _end_aggregate(self, t: float) -> None:
        # Aggregation runs from ``aggregating`` to the round's next event (lock held).
        if self._aggregating is not None:
            self.phase_seconds.labels(phase="aggregate").observe(max(0.0, t - self._aggregating))
            self._aggregating = None

    def _count_failures(self, phase: str) -> None:
        # round_closed is emitted after the phase closed: its failures no longer change.
        rnd = self.fleet.current_round
        if rnd is None or not rnd.closed:
            return
        for failure in list(rnd.failures.values()):
            self.failures.labels(phase=phase, reason=failure_reason(failure.reason)).inc()

    def _observe_goodput(self) -> None:
        # The closed fit phase's results no longer change (lock held).
        rnd = self.fleet.current_round
        if rnd is not None and rnd.closed:
            self.goodput.observe([r for r in rnd.results.values() if isinstance(r, FitRes)])

    def on_fit_results(self, results: Sequence[FitRes]) -> None:
        """Counts the time splits of a closed fit phase's ``results`` (those that carry one) in
        the goodput histograms and keeps each client's last for ``/api/status``. The fit
        phase's ``round_closed`` event calls it with the fleet's results."""
        with self._lock:
            self.goodput.observe(results)

    def on_round(self, m: RoundMetrics) -> None:
        """The engine's ``on_round``: a round's totals, as ``metrics.jsonl`` has them."""
        self.bytes.labels(direction="up").inc(m.bytes_up)
        self.bytes.labels(direction="down").inc(m.bytes_down)
        self.results.labels(outcome="ok").inc(m.clients_ok)
        self.results.labels(outcome="failed").inc(m.clients_failed)
        self.round_seconds.observe(m.wall_s)

    def _client_count(self) -> float:
        with self.fleet.membership.lock:
            return float(len(self.fleet.membership.records))

    # -- views -----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What ``/api/status`` serves (see the README's "Watching a federation")."""
        now_mono, now = self.fleet.clock.now(), time.time()  # last_seen is in the fleet clock's time
        rnd = self.fleet.current_round
        limit = SILENCE_INTERVALS * self.fleet.heartbeat_interval_s
        with self.fleet.membership.lock:  # a snapshot: the records are not changed here
            records = [
                (r.info, r.last_seen, r.benched_task, r.polls, r.progress)
                for r in self.fleet.membership.records.values()
            ]
            progress = None
            if rnd is not None:
                progress = {
                    "round": rnd.server_round,
                    "phase": rnd.kind,
                    "results": len(rnd.results),
                    "failures": len(rnd.failures),
                    "expected": len(rnd.assignments),
                    "closed": rnd.closed,
                }
            # The last round's outcome stays visible until the next one opens (a closed round
            # still knows who reported); over-selected clients it no longer waits for are idle.
            assigned = {} if rnd is None else {cid: self._task_state(rnd, cid) for cid in rnd.assignments}
        records.sort(key=lambda r: r[0].sort_key)
        with self._lock:
            state, phase, current = self.state, self.phase, self.current
            splits = self.goodput.splits_of({r[0].client_id for r in records})
        clients = _client_rows(
            records[:MAX_STATUS_CLIENTS], assigned, splits, now_mono=now_mono, now=now, limit=limit
        )
        history = [_history_row(m) for m in list(self._history())]
        return {
            "run_id": self.run_id,
            "state": state,
            "round": current or len(history),
            "rounds": self.rounds,
            "committed": len(history),
            "phase": phase,
            "progress": progress,
            "clients_total": len(records),
            "clients": clients,
            "regions": region_rows([r[:4] for r in records], splits),
            "history": history,
            "time": round(now, 3),
        }

    @staticmethod
    def _task_state(rnd: Any, cid: str) -> str:
        if cid in rnd.results:
            return "reported"
        if cid in rnd.failures:
            return "failed"
        if rnd.closed:
            return ""  # asked, but the round closed without it: its own state shows
        if cid in rnd.uploading:
            return "uploading"
        return {"fit": "training", "evaluate": "evaluating"}.get(rnd.kind, "exchanging")

    def metrics_text(self) -> bytes:
        return self._generate_latest(self.registry)

    def routes(self) -> dict[str, Route]:
        """The HTTP routes: ``/`` (public static page), ``/metrics``, ``/api/status``."""
        return {
            "/": Route(page_response, public=True),
            "/index.html": Route(page_response, public=True),
            "/metrics": Route(lambda: Response(self.metrics_text(), content_type=self._content_type)),
            "/api/status": Route(
                lambda: Response(
                    strict_json(self.status(), ensure_ascii=True).encode(),
                    content_type="application/json",
                )
            ),
        }

    def interceptor(self) -> RpcTimer:
        return RpcTimer(self.rpc_seconds)


#: What each kind of event does to the monitor (``CoordinatorMonitor.on_event``); other kinds do nothing.
_EVENT_HANDLERS: dict[str, Callable[[CoordinatorMonitor, Event], None]] = {
    "started": CoordinatorMonitor._started,
    "client_joined": CoordinatorMonitor._client_joined,
    "client_left": CoordinatorMonitor._client_gone,
    "client_dropped": CoordinatorMonitor._client_gone,
    "round_opened": CoordinatorMonitor._round_opened,
    "update_accepted": CoordinatorMonitor._update_accepted,
    "messages_accepted": CoordinatorMonitor._messages_accepted,
    "round_closed": CoordinatorMonitor._round_closed,
    "aggregating": CoordinatorMonitor._aggregating_started,
    "checkpoint_writing": CoordinatorMonitor._checkpoint_writing,
    "checkpoint_written": CoordinatorMonitor._checkpoint_written,
    "round_committed": CoordinatorMonitor._round_ended,
    "round_failed": CoordinatorMonitor._round_ended,
    "finished": CoordinatorMonitor._run_ended,
    "stopped": CoordinatorMonitor._run_ended,
}


def _client_rows(
    records: Sequence[tuple[ClientInfo, float, str, int, dict[str, float | int] | None]],
    assigned: dict[str, str],
    splits: dict[str, dict[str, float]],
    *,
    now_mono: float,
    now: float,
    limit: float,
) -> list[dict[str, Any]]:
    """The ``clients`` of ``/api/status``: each record ``(info, last_seen, benched_task, polls,
    progress)`` with its state (its task's in the open round, else benched, silent past ``limit``
    or idle), its running task's ``progress`` as its heartbeats report it (``None`` between tasks;
    ``server/progress.py``) and its last fit split from ``splits`` (``None`` each before its first)."""
    clients = []
    for info, last_seen, benched, polls, progress in records:
        ago = max(0.0, now_mono - last_seen)
        state = assigned.get(info.client_id) or (
            "benched" if benched else "silent" if ago > limit and polls == 0 else "idle"
        )
        clients.append(
            {
                "id": info.client_id,
                "name": info.name,
                "region": info.region,
                "state": state,
                "last_seen": round(now - ago, 3),
                "last_seen_s": round(ago, 3),
                "device": info.device,
                "accelerators": info.num_accelerators,
                "memory_bytes": info.memory_bytes,
                "progress": progress,
                **{key: splits.get(info.client_id, {}).get(key) for key in SPLIT_FIELDS},
            }
        )
    return clients


def _history_row(m: RoundMetrics) -> dict[str, Any]:
    """A committed round in ``/api/status``'s ``history``."""
    return {
        "round": m.round,
        "accuracy": m.accuracy,
        "loss": m.loss,
        "bytes_up": m.bytes_up,
        "bytes_down": m.bytes_down,
        "wall_s": round(m.wall_s, 6),
        "clients_ok": m.clients_ok,
        "clients_failed": m.clients_failed,
        "failed": bool(m.extra.get("round_failed")),
    }
