"""A client's ``/metrics``: what ``fedgrid client --http HOST:PORT`` serves.

Fed by ``run``'s ``on_task`` (one ``TaskReport`` per finished task), in a registry of its own
(never prometheus-client's global one), served read-only by ``fedgrid.webserve``:

| metric | labels | what |
|---|---|---|
| ``fedgrid_client_rounds_trained_total`` | | fit tasks trained and uploaded |
| ``fedgrid_client_tasks_total`` | ``kind`` (``fit``, ``evaluate``) | tasks finished |
| ``fedgrid_client_examples_total`` | ``kind`` | examples the results claimed |
| ``fedgrid_client_last_loss`` | | the latest fit result's loss (NaN before one) |
| ``fedgrid_client_last_round`` | | the round of the latest task |
| ``fedgrid_client_bytes_total`` | ``direction`` (``up``, ``down``) | wire bytes of uploads (every try) and downloads |
| ``fedgrid_client_upload_retries_total`` | | upload tries after the first |
"""

from __future__ import annotations

from fedgrid.client.runtime import TaskReport
from fedgrid.webserve import Response, Route, StatusServer, require_prometheus

__all__ = ["ClientMonitor", "serve_client_metrics"]


class ClientMonitor:
    """The metrics of one client.

    Raises:
        ConfigError: ``prometheus-client`` is not installed (the message names the extra).
    """

    def __init__(self) -> None:
        prom = require_prometheus()
        self.registry = r = prom.CollectorRegistry(auto_describe=True)
        self.rounds = prom.Counter("fedgrid_client_rounds_trained", "fit tasks trained and uploaded", registry=r)
        self.tasks = prom.Counter("fedgrid_client_tasks", "tasks finished", ["kind"], registry=r)
        self.examples = prom.Counter("fedgrid_client_examples", "examples the results claimed", ["kind"], registry=r)
        self.last_loss = prom.Gauge("fedgrid_client_last_loss", "the latest fit result's loss", registry=r)
        self.last_loss.set(float("nan"))
        self.last_round = prom.Gauge("fedgrid_client_last_round", "the round of the latest task", registry=r)
        self.bytes = prom.Counter("fedgrid_client_bytes", "wire bytes moved", ["direction"], registry=r)
        self.retries = prom.Counter("fedgrid_client_upload_retries", "upload tries after the first", registry=r)
        for kind in ("fit", "evaluate"):
            self.tasks.labels(kind=kind)
            self.examples.labels(kind=kind)
        for direction in ("up", "down"):
            self.bytes.labels(direction=direction)
        self._generate, self._content_type = prom.generate_latest, prom.CONTENT_TYPE_LATEST

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

    def routes(self) -> dict[str, Route]:
        return {"/metrics": Route(lambda: Response(self._generate(self.registry), content_type=self._content_type))}


def serve_client_metrics(address: str, *, token_file: str = "") -> tuple[ClientMonitor, StatusServer]:
    """A started ``StatusServer`` on ``address`` serving a new ``ClientMonitor``'s ``/metrics``.

    Raises:
        ConfigError: no prometheus-client, a bad address, or a non-loopback host without a token.
    """
    monitor = ClientMonitor()
    return monitor, StatusServer(address, monitor.routes(), token_file=token_file, key="http").start()
