"""A region for tests: ``python event_region.py [ROUND EVENT] -- ARGS`` runs ``fedgrid region
ARGS`` and, with ``ROUND EVENT``, SIGKILLs itself on the emitting thread right after ``EVENT``
happens for a round at or after ``ROUND``, so the kill lands at that point every time.

``EVENT`` is one of the region's own events (``fedgrid.events``: ``update_accepted``,
``round_committed``..., with its regional round), or one of its upstream side (with the global
round of the task):

- ``upstream_encoded``: the region's result is encoded for the WAN (its uplink's error feedback
  moved on), before any byte of it is sent;
- ``upstream_uploaded``: the global coordinator accepted the upload;
- ``upstream_saved``: the region's upstream state file (``upstream.pt``) was written.

Errors end it as ``fedgrid region`` ends: one line, exit status 1."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from fedgrid.cli import build_parser
from fedgrid.cli.region import serve
from fedgrid.cli.support import REGION_KEYS, config_from, error_line
from fedgrid.errors import FedgridError


def main(argv: list[str]) -> int:
    split = argv.index("--")
    fault, flags = argv[:split], argv[split + 1 :]
    trigger = (int(fault[0]), fault[1]) if fault else None
    lock = threading.Lock()
    fired = False

    def hook(event: str, server_round: int) -> None:
        nonlocal fired
        with lock:
            if trigger is not None and not fired and event == trigger[1] and server_round >= trigger[0]:
                fired = True
                print(f"event_region: SIGKILL at {event} of round {server_round}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    _install(hook)
    config = config_from(build_parser().parse_args(["region", *flags]), REGION_KEYS)
    try:
        serve(config)
    except FedgridError as exc:
        print(error_line(exc), file=sys.stderr)
        return 1
    return 0


def _install(hook: Any) -> None:
    """Wraps the region's event log, its upstream connection's encoder and upload, and its state
    writes, so that each calls ``hook(event, round)`` after doing its work."""
    import fedgrid.client.runtime as runtime
    from fedgrid.client.connection import Connection
    from fedgrid.client.uplink import UplinkEncoder
    from fedgrid.events import EventLog

    emit, upload, encode = EventLog.emit, Connection.upload, UplinkEncoder.encode
    save, begin = runtime.save_client_state, UplinkEncoder.begin
    rounds: dict[int, int] = {}  # id(encoder) -> the round it encodes

    def emitting(self: EventLog, event: str, **fields: Any) -> None:
        emit(self, event, **fields)
        hook(event, int(fields.get("round", 0)))

    def beginning(self: UplinkEncoder, server_round: int, *args: Any, **kwargs: Any) -> UplinkEncoder:
        rounds[id(self)] = server_round
        return begin(self, server_round, *args, **kwargs)

    def encoding(self: UplinkEncoder, **kwargs: Any) -> Any:
        out = encode(self, **kwargs)
        hook("upstream_encoded", rounds.get(id(self), 0))
        return out

    def uploading(self: Connection, task_id: str, server_round: int, *args: Any, **kwargs: Any) -> int:
        out = upload(self, task_id, server_round, *args, **kwargs)
        hook("upstream_uploaded", server_round)
        return out

    def saving(path: Any, **kwargs: Any) -> None:
        save(path, **kwargs)
        hook("upstream_saved", int(kwargs.get("server_round", 0)))

    EventLog.emit = emitting  # type: ignore[method-assign]
    UplinkEncoder.begin = beginning  # type: ignore[method-assign]
    UplinkEncoder.encode = encoding  # type: ignore[method-assign]
    Connection.upload = uploading  # type: ignore[method-assign]
    runtime.save_client_state = saving


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
