"""Log lines that clients cause, at a bounded rate.

Anyone who can reach a plaintext loopback coordinator can Join as often as it likes, and a
peer can open calls that are refused as fast as it can send them: one line per event would
let it fill the disk (20,000 Joins wrote 4 MB of log). A ``LogBudget`` logs the first
``lines`` records of its kind in each ``interval_s`` as they come, counts the rest, and
then says how many it left out in one summary line, at the next record or ``flush`` after
the interval ends. What a line quotes of a client's text goes through
``fedgrid.textsafe.escape`` at the call site, as for every other line.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from fedgrid.constants import LOG_BURST_LINES, LOG_SUMMARY_S

__all__ = ["LogBudget"]


class LogBudget:
    """At most ``lines`` records per ``interval_s`` of one kind (``what``: "joins") to ``logger``.

    Args:
        logger: where the records and summaries go.
        what: the kind of record, plural, as the summary names it ("clients joined").
        lines: records logged one by one per interval.
        interval_s: the interval.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        lines: int = LOG_BURST_LINES,
        interval_s: float = LOG_SUMMARY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lines < 0 or interval_s <= 0:
            raise ValueError(
                f"log budget of {what}: lines >= 0 and interval_s > 0, got {lines} and {interval_s}"
            )
        self.logger, self.what, self.lines, self.interval_s, self.clock = (
            logger,
            what,
            lines,
            interval_s,
            clock,
        )
        self._lock = threading.Lock()
        self._start = clock()
        self._logged = 0
        self._left_out = 0
        self.left_out_total = 0  # records not logged one by one, since the start

    def log(self, level: int, msg: str, *args: object) -> bool:
        """Logs the record if the interval's budget allows; returns whether it did."""
        with self._lock:
            self._roll()
            if self._logged >= self.lines:
                self._left_out += 1
                self.left_out_total += 1
                return False
            self._logged += 1
        self.logger.log(level, msg, *args)
        return True

    def flush(self) -> None:
        """Writes the summary of an interval that has ended, if it left records out."""
        with self._lock:
            self._roll()

    def _roll(self) -> None:
        """Starts a new interval once the current one ended, summing up the last (lock held)."""
        now = self.clock()
        if now - self._start < self.interval_s:
            return
        if self._left_out:
            self.logger.info(
                "%d more %s in the last %.0fs (at most %d a line each per %.0fs)",
                self._left_out,
                self.what,
                now - self._start,
                self.lines,
                self.interval_s,
            )
        self._start, self._logged, self._left_out = now, 0, 0
