"""A coordinator for tests: ``python event_coordinator.py [ROUND EVENT SIGNAL] -- ARGS`` runs
``fedgrid coordinator ARGS`` and prints each event it emits (``fedgrid.events``) on stdout
as ``EVENT {json}``, as it happens, for the test to read without polling. Fault injection:
with ``ROUND EVENT SIGNAL`` it sends itself ``SIGNAL`` (``SIGKILL`` or ``SIGTERM``) right
after printing ``EVENT`` for a round at or after ``ROUND``, on the emitting thread, so a kill
lands inside the phase that event opens, every time. ``SIGNAL`` may also be ``ENOSPC``: from
then on every write under the state directory fails with "No space left on device"
(``full_disk``). Errors end it as ``fedgrid coordinator`` ends: one line, exit status 1.

With ``SLOW_EVAL_S`` set, the server-side evaluation of each round takes that many more seconds,
in steps of 50 ms that check for a stop as the built-in evaluation's batches do (a slow evaluator)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading

from fedgrid.cli import COORDINATOR_KEYS, build_parser, serve
from fedgrid.cli.support import error_line
from fedgrid.config import load_config, parse_flags
from fedgrid.errors import FedgridError
from fedgrid.events import Event
from fedgrid.interrupts import stop_status

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/support
from full_disk import install_full_disk  # noqa: E402


def main(argv: list[str]) -> int:
    split = argv.index("--")
    fault, flags = argv[:split], argv[split + 1 :]
    trigger = (int(fault[0]), fault[1], fault[2]) if fault else None
    args = build_parser().parse_args(["coordinator", *flags])
    config = load_config(args.config, parse_flags({k: getattr(args, k, None) for k in COORDINATOR_KEYS}))
    lock = threading.Lock()
    fired = False

    def hook(event: Event) -> None:
        nonlocal fired
        with lock:
            sys.stdout.write("EVENT " + json.dumps({"event": event.event, **event.fields}) + "\n")
            sys.stdout.flush()
            if (
                trigger is not None
                and not fired
                and event.event == trigger[1]
                and event.get("round", 0) >= trigger[0]
            ):
                fired = True
                if trigger[2] == "ENOSPC":
                    install_full_disk(config.state_dir)
                else:
                    os.kill(os.getpid(), getattr(signal, trigger[2]))

    if os.environ.get("SLOW_EVAL_S"):
        _slow_evaluation(float(os.environ["SLOW_EVAL_S"]))
    try:
        serve(config, on_event=hook)
    except FedgridError as exc:
        print(error_line(exc), file=sys.stderr)
        return 1
    return stop_status() or 0  # as `fedgrid coordinator` exits: 128 + the signal that stopped it


def _slow_evaluation(seconds: float) -> None:
    """Makes the built-in task's server-side evaluation take ``seconds`` more (``SLOW_EVAL_S``)."""
    import time

    from fedgrid.simulation import tasks
    from fedgrid.simulation.evaluation import check_stop

    resolve = tasks.resolve

    def slow_resolve(**kwargs):
        resolved = resolve(**kwargs)
        evaluate = resolved.evaluate

        def slow(state):
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                check_stop()  # between two "batches", as the built-in evaluation does
                time.sleep(0.05)  # stands in for a batch's compute
            return evaluate(state)

        return dataclasses.replace(resolved, evaluate=slow)

    tasks.resolve = slow_resolve


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
