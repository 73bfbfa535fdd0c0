"""The client's heartbeat: a background thread that tells the coordinator the session is alive
between calls (``Heartbeat``), for ``fedgrid.client.runtime.run_client`` and the embedding
``fedgrid.client.session.Session``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import grpc

from fedgrid.client.connection import Connection
from fedgrid.client.progress import ProgressBoard

__all__ = ["Heartbeat"]

# The connection's logger: these records have always come from it.
log = logging.getLogger("fedgrid.client.connection")


class Heartbeat(threading.Thread):
    """Heartbeats every interval, each sent without waiting for the last one's answer.

    Over a saturated link the answers wait behind the client's own download (one
    connection), seconds each; a heartbeat that waited for its answer before the next would
    reach the coordinator that rarely, and the client would be taken for silent. Each has
    the RPC deadline, so at most ``rpc_timeout / interval + 1`` are ever outstanding.
    """

    def __init__(
        self, conn: Connection, stop: threading.Event, progress: ProgressBoard | None = None
    ) -> None:
        super().__init__(name="fedgrid-heartbeat", daemon=True)
        self.conn, self.stop = conn, stop
        #: The client's running task, each heartbeat carries its latest figures (the status page's).
        self.progress = progress

    def run(self) -> None:
        interval = self.conn.heartbeat_interval_s
        in_flight: list[Any] = []
        try:
            while not self.stop.wait(interval):
                for future in [f for f in in_flight if f.done()]:
                    in_flight.remove(future)
                    try:
                        interval = future.result().interval_s or interval
                    except grpc.RpcError as exc:
                        log.debug("heartbeat failed: %s", exc.code())  # the main loop's retries decide
                if self.conn.polling:  # a client holding a poll counts as alive
                    continue
                if (
                    len(in_flight) > self.conn.rpc_timeout / max(interval, 1e-3) + 1
                ):  # a deadline that did not fire: never pile up
                    continue
                try:
                    latest = self.progress.latest if self.progress is not None else None
                    in_flight.append(self.conn.heartbeat_future(latest))
                except ValueError:  # the channel closed as the run ended
                    return
        finally:
            # One in flight when the process exits can abort grpc's C++ core: end them first.
            for future in in_flight:
                future.cancel()
