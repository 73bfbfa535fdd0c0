"""``LogBudget``: a burst of records, then one summary line per interval."""

from __future__ import annotations

import logging

import pytest

from fedgrid.server.log_budget import LogBudget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_costs_a_burst_and_a_summary_line(caplog):
    clock = Clock()
    logger = logging.getLogger("fedgrid.test.budget")
    budget = LogBudget(logger, "clients joined", lines=3, interval_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="fedgrid.test.budget"):
        logged = [budget.log(logging.INFO, "client %s joined", f"c{i}") for i in range(20_000)]
        assert logged[:3] == [True] * 3 and not any(logged[3:])
        budget.flush()  # the interval has not ended: no summary yet
        clock.now += 10.0
        budget.flush()
        budget.flush()  # said once
        clock.now += 5.0
        assert budget.log(logging.INFO, "client %s joined", "late")  # a new interval: logged again
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "client c0 joined",
        "client c1 joined",
        "client c2 joined",
        "19997 more clients joined in the last 10s (at most 3 a line each per 10s)",
        "client late joined",
    ]
    assert budget.left_out_total == 19_997


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="log budget of joins"):
        LogBudget(logging.getLogger("x"), "joins", lines=-1)
    with pytest.raises(ValueError, match="interval_s > 0"):
        LogBudget(logging.getLogger("x"), "joins", interval_s=0)
