"""A fit result on its way (``Session.submit_nowait``): its upload, then the poll and download
of the next task, in a background thread while the host program trains (overlapped syncs)."""

from __future__ import annotations

import threading
import time
from typing import Callable

from fedgrid.client.task_feed import TaskReport

__all__ = ["Delivery"]


class Delivery:
    """A fit result on its way (``Session.submit_nowait``): its upload, then the poll and download
    of the next task, in a background thread of the session.

    Attributes:
        waited_s: seconds the host blocked in ``wait`` (a sync later than its tau steps).
        next_round: once ``done``, the round of the task fetched next (``None``: the run
            finished or the session closed).
    """

    def __init__(self, work: Callable[[], TaskReport | None]) -> None:
        self.waited_s = 0.0
        self.next_round: int | None = None
        self._report: TaskReport | None = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._report = work()
            except BaseException as exc:  # handed to wait() and to the next tasks() item
                self._error = exc

        self._thread = threading.Thread(target=run, name="fedgrid-session-delivery", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """Whether the upload landed (or failed) and the next task is here (or the run ended)."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> TaskReport | None:
        """Blocks until ``done``; returns the upload's ``TaskReport`` (``None``: it did not land,
        ``on_error`` says why). The seconds blocked add to ``waited_s``.

        Raises:
            TimeoutError: not done within ``timeout`` seconds (it goes on; wait again).
            RpcFailed: what the upload or the poll raised, as ``submit`` and ``tasks()`` would.
        """
        began = time.monotonic()
        self._thread.join(timeout)
        self.waited_s += time.monotonic() - began
        if self._thread.is_alive():
            raise TimeoutError(f"the upload and the next task still on their way after {timeout}s")
        if self._error is not None:
            raise self._error
        return self._report
