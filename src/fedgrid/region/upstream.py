"""A region's upstream side: it joins the global coordinator as one client and serves its tasks.

Transient failures (an unreachable or restarting global coordinator, a Join it answers with
``RESOURCE_EXHAUSTED``) are tried again with backoff, for as long as the region runs; its own
clients stay joined meanwhile. A refusal that joining again cannot change ends the region with
that reason instead (``RefusedUpstream``): another base model or LoRA rank, a malformed Join,
a certificate the global coordinator does not take, or the region's name taken by another
process. A Join refused because the global run is over ends the region as finished.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import timedelta
from pathlib import Path
from typing import Callable

import grpc

from fedgrid.client.api import Client
from fedgrid.client.rpc import IdentityConflict
from fedgrid.client.runtime import RpcFailed, TaskReport, run_client
from fedgrid.config import Config
from fedgrid.errors import RUN_FINISHED, FedgridError
from fedgrid.interrupts import say
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.textsafe import escape

__all__ = [
    "UPSTREAM_RETRY_MAX_S",
    "UPSTREAM_STATE",
    "REFUSED_FOR_GOOD",
    "RefusedUpstream",
    "serve_upstream",
    "wan_writer",
]

log = logging.getLogger(__name__)

#: Longest wait between two tries to join the global coordinator again.
UPSTREAM_RETRY_MAX_S = 60.0
#: The region's state as a client upstream (``fedgrid.client.state``), in its state directory.
UPSTREAM_STATE = "upstream.pt"
#: Upstream refusals that joining again cannot change.
REFUSED_FOR_GOOD = frozenset(
    {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED}
)


class RefusedUpstream(FedgridError):
    """The global coordinator refuses this region for a reason joining again cannot change."""

    def __init__(self, name: str, upstream: str, exc: RpcFailed) -> None:
        super().__init__(
            f"region {name}: the global coordinator at {upstream} refuses it ({exc.code.name}: {exc.details}); "
            "joining again cannot change that, so the region stops: fix what the refusal names and start it again"
        )
        self.code = exc.code


def wan_writer(path: Path) -> Callable[[TaskReport], None]:
    """Appends each global task's WAN bytes to ``path`` (``wan.jsonl``), one JSON object a line."""

    def on_task(report: TaskReport) -> None:
        row = {
            "round": report.round,
            "kind": report.kind,
            "bytes_up": report.bytes_up,
            "bytes_down": report.bytes_down,
            "upload_retries": report.upload_retries,
            "num_examples": report.num_examples,
        }
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    return on_task


def serve_upstream(
    config: Config,
    region: Client,
    fleet: RemoteFleet,
    stop: threading.Event,
    on_task: Callable[[TaskReport], None],
) -> tuple[int, bool]:
    """Serves the global coordinator's tasks once the region has its clients, joining upstream
    again (with backoff) while it refuses the region for a transient reason; returns the global
    tasks trained and whether the global run finished (``False``: stopped).

    Raises:
        RefusedUpstream: a refusal in ``REFUSED_FOR_GOOD``, or the region's name taken by another process.
    """
    backoff = 1.0
    while not stop.is_set():
        try:
            # Its clients first: the examples it reports at join are theirs.
            fleet.wait_for_clients(
                min_clients=config.min_clients, timeout=timedelta(seconds=min(config.join_timeout_s, 5.0))
            )
        except Exception:  # not enough clients yet (or stopping): look again
            continue
        try:
            # Transient failures are retried with the same session for as long as the region runs: a global
            # coordinator restarted from its state directory still knows it (and its task), a new one refuses
            # it and the runtime joins again.
            summary = run_client(
                region,
                config.upstream,
                stop=stop,
                ca=config.upstream_ca,
                cert=config.upstream_cert,
                key=config.upstream_key,
                server_name=config.upstream_server_name,
                on_task=on_task,
                connect_timeout=UPSTREAM_RETRY_MAX_S,
                retry_max_elapsed=float("inf"),
                # The WAN uplink's error-feedback residual, as every client keeps it: a region
                # restarted from its state directory sends what it would have sent unkilled.
                state_path=Path(config.state_dir) / UPSTREAM_STATE if config.state_dir else None,
            )
            return summary.rounds, not stop.is_set()
        except RpcFailed as exc:  # refused upstream (or unreachable at the first join)
            if exc.reason == RUN_FINISHED:
                return 0, True
            if exc.code in REFUSED_FOR_GOOD or isinstance(exc, IdentityConflict):
                raise RefusedUpstream(config.name, config.upstream, exc) from exc
            log.warning(
                "region %s: upstream %s: %s; joining again in %.0fs",
                escape(config.name),
                config.upstream,
                escape(str(exc)),
                backoff,
            )
            say(f"region {config.name}: upstream lost ({exc.code.name}); its clients stay; joining again")
            stop.wait(backoff)
            backoff = min(backoff * 2, UPSTREAM_RETRY_MAX_S)
    return 0, False
