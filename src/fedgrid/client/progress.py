"""Progress inside a task: steps done, examples (and tokens) per second, time left.

A client's training loop counts its steps in a ``TaskProgress``. At most every
``LOG_EVERY_S`` seconds (of its clock: a test drives a ``fedgrid.clock.ManualClock``) it logs
one line on the ``fedgrid.client.progress`` logger (``--quiet`` silences that logger) and
leaves the figures on the client's ``ProgressBoard``, which its heartbeats carry to the
coordinator's status page (``TaskProgress`` in the protocol). Listeners (``listen``: a local
run's progress bar on a terminal) hear every step's figures at most every ``TICK_S``.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable

from fedgrid.clock import MONOTONIC, Clock
from fedgrid.constants import PROGRESS_LOG_S

__all__ = ["LOG_EVERY_S", "TICK_S", "ProgressReport", "ProgressBoard", "TaskProgress", "listen", "clock_text"]

log = logging.getLogger(__name__)

#: The most often a client logs its progress inside a task (FEDGRID_PROGRESS_LOG_S).
LOG_EVERY_S = PROGRESS_LOG_S
#: The most often listeners (a progress bar) hear it.
TICK_S = 0.5

_listeners: list[Callable[["ProgressReport"], None]] = []
_listeners_lock = threading.Lock()


def listen(listener: Callable[["ProgressReport"], None] | None) -> None:
    """Makes ``listener`` the one that hears every task's figures in this process (a local run's
    progress bar); ``None``: none."""
    with _listeners_lock:
        _listeners.clear()
        if listener is not None:
            _listeners.append(listener)


def clock_text(seconds: float) -> str:
    """``H:MM:SS`` of ``seconds`` (``?`` when unknown: negative or not finite)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


@dataclass(frozen=True)
class ProgressReport:
    """Where a task is: ``steps_total`` 0 when unknown, ``eta_s`` -1 when unknown."""

    round: int
    steps_done: int
    steps_total: int
    examples_per_s: float
    tokens_per_s: float
    eta_s: float

    def line(self) -> str:
        """``round 3: step 120/500, 85.2 examples/s, 1,204 tokens/s, 0:01:05 left``."""
        steps = (
            f"step {self.steps_done}/{self.steps_total}" if self.steps_total else f"step {self.steps_done}"
        )
        tokens = f", {self.tokens_per_s:,.0f} tokens/s" if self.tokens_per_s else ""
        return f"round {self.round}: {steps}, {self.examples_per_s:.1f} examples/s{tokens}, {clock_text(self.eta_s)} left"


class ProgressBoard:
    """The latest figures of a client's running task (``None`` between tasks), for its heartbeats."""

    def __init__(self) -> None:
        self.latest: ProgressReport | None = None


class TaskProgress:
    """Counts one task's steps; reports as the module docstring says.

    Args:
        round: the task's round.
        steps_total: the steps the task will take (0: unknown).
        time_s: a task bounded in time: its seconds (the time left follows them).
        board: where the latest figures go (the client's ``ProgressBoard``).
        clock: the time (``fedgrid.clock``; a test's ``ManualClock``).
    """

    def __init__(
        self,
        *,
        round: int,
        steps_total: int,
        time_s: float = 0.0,
        board: ProgressBoard | None = None,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.round, self.steps_total, self.time_s = round, max(0, steps_total), time_s
        self.board, self.clock = board, clock
        self.began = self._logged = self._ticked = clock.now()
        self.steps = self.examples = self.tokens = 0

    def step(self, examples: int, tokens: int = 0) -> None:
        """One step of ``examples`` examples (``tokens`` tokens) done."""
        self.steps += 1
        self.examples += examples
        self.tokens += tokens
        now = self.clock.now()
        if now - self._ticked >= TICK_S:
            self._ticked = now
            report = self.report(now)
            if self.board is not None:
                self.board.latest = report
            with _listeners_lock:
                listeners = list(_listeners)
            for listener in listeners:
                listener(report)
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            log.info("%s", self.report(now).line())

    def report(self, now: float) -> ProgressReport:
        elapsed = max(now - self.began, 1e-9)
        if self.time_s > 0:
            eta = max(0.0, self.time_s - elapsed)
        elif self.steps_total and self.steps:
            eta = max(0, self.steps_total - self.steps) * elapsed / self.steps
        else:
            eta = -1.0
        return ProgressReport(
            round=self.round,
            steps_done=self.steps,
            steps_total=self.steps_total,
            examples_per_s=self.examples / elapsed,
            tokens_per_s=self.tokens / elapsed,
            eta_s=eta,
        )

    def close(self) -> None:
        """The task's training ended: the board holds no figures of it any more."""
        if self.board is not None:
            self.board.latest = None
