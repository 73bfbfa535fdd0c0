"""Fault injection (a test utility): ``python fault_coordinator.py ROUND EVENT SIGNAL -- ARGS``
runs ``fedgrid coordinator ARGS`` and sends itself ``SIGNAL`` (``SIGKILL`` or ``SIGTERM``)
the moment it emits ``EVENT`` (``fedgrid.events``) for a round at or after ``ROUND``,
on the emitting thread: a kill lands inside the phase the event opens, every time."""

from __future__ import annotations

import os
import signal
import sys

from fedgrid.cli import COORDINATOR_KEYS, build_parser, serve
from fedgrid.config import load_config
from fedgrid.events import Event


def main(argv: list[str]) -> int:
    server_round, name, sig_name = int(argv[0]), argv[1], argv[2]
    assert argv[3] == "--"
    sig = getattr(signal, sig_name)
    args = build_parser().parse_args(["coordinator", *argv[4:]])
    config = load_config(args.config, {k: getattr(args, k) for k in COORDINATOR_KEYS if getattr(args, k, None) is not None})
    fired = False

    def hook(event: Event) -> None:
        nonlocal fired
        if not fired and event.event == name and event.get("round", 0) >= server_round:
            fired = True
            os.kill(os.getpid(), sig)

    serve(config, on_event=hook)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
