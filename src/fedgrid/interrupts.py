"""Ctrl-C and SIGTERM for the long-running commands: the first one stops gracefully, a second forces the exit.

A process that is stopping gracefully (a coordinator letting in-flight requests finish, a
client telling the coordinator it leaves, a simulation finishing its round) can take
seconds; a user who presses Ctrl-C again means "now", and gets one line and exit status
130 rather than a traceback from whatever the process was doing.

A command stopped gracefully exits as the shell reports a process the signal ended, 128 + its
number (``stop_status``: 130 after Ctrl-C, 143 after SIGTERM), never 0: a script that runs
``fedgrid simulate && next`` does not go on after an interrupted run.

Long compute between two looks at the network (a client's training loop, the coordinator's
evaluation and aggregation, a simulation's clients) asks ``stopping()`` between its steps or
batches and gives up at once (``InterruptedRunError``) once a first signal arrived, so that a
stop ends the process within seconds whatever it was doing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Callable, TextIO

__all__ = ["GracefulStop", "FORCED_EXIT_STATUS", "say", "stop_status", "forget_stop", "stopping"]

#: Exit status of a forced exit (the shell's 128 + SIGINT).
FORCED_EXIT_STATUS = 130
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: The signal that began this process's graceful stop (signals belong to the process, so does this).
_began: list[int] = []
#: Set by the first signal: long compute gives up between its steps (``stopping``).
_stop_requested = threading.Event()


def stopping() -> bool:
    """Whether a first SIGINT or SIGTERM asked this process to stop (since ``forget_stop``): a
    loop over steps or batches checks it between two and gives up."""
    return _stop_requested.is_set()


def stop_status() -> int | None:
    """128 + the number of the signal that began a graceful stop in this process (130: SIGINT,
    143: SIGTERM), or ``None`` when none did (since ``forget_stop``)."""
    return 128 + _began[0] if _began else None


def forget_stop() -> None:
    """Forgets the signal ``stop_status`` reports and ``stopping`` (a command run again in the same process)."""
    _began.clear()
    _stop_requested.clear()


def say(line: str, *, stream: TextIO | None = None) -> None:
    """Writes ``line`` from a signal handler: straight to the file descriptor, since the
    handler may run while the main thread is inside a ``print`` to the same buffered stream
    (a second write into it raises "reentrant call"). What was printed before with
    ``flush=True`` comes first."""
    stream = stream if stream is not None else sys.stdout
    try:
        os.write(stream.fileno(), (line + "\n").encode())
    except (OSError, ValueError, AttributeError):  # no descriptor (a test's capture): the stream itself
        stream.write(line + "\n")
        stream.flush()


class GracefulStop:
    """Installs handlers for SIGINT and SIGTERM for the duration of a ``with`` block.

    The first signal calls ``on_stop(signal_name)`` (which may raise, e.g. ``KeyboardInterrupt``
    to unwind a blocking call); any later one writes ``fedgrid: <what>: interrupted again,
    exiting now`` to stderr and ends the process at once with status 130 (``os._exit``: the
    graceful stop in progress is what a second signal cuts short).

    Outside the main thread (an embedding program, a test) it installs nothing: Python only
    delivers signals there.

    Args:
        on_stop: the graceful stop.
        what: the command, named in the forced-exit line.
    """

    def __init__(self, on_stop: Callable[[str], None], *, what: str) -> None:
        self.on_stop = on_stop
        self.what = what
        #: The first signal's name once one arrived.
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            say(f"fedgrid {self.what}: {name} again while stopping: exiting now", stream=sys.stderr)
            os._exit(FORCED_EXIT_STATUS)
        self.received = name
        if not _began:
            _began.append(signum)
        _stop_requested.set()
        self.on_stop(name)

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()
