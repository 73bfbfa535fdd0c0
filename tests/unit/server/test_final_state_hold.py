"""``FinalStateHold`` (``server/status_page.py``): a finished run's status server waits for the
watching page to read the final state, and only for a page that is watching. Its clock is the
test's (a ``ManualClock``): the limit passes when the test advances it."""

from __future__ import annotations

import threading

import pytest

from fedgrid.clock import ManualClock
from fedgrid.server.status_page import STATUS_PATH, FinalStateHold
from fedgrid.webserve import Response, Route

from clocked import asleep


class Status:
    """A ``/api/status`` route whose run ends when ``final`` is set; counts its calls."""

    def __init__(self, *, limit_s: float, status: int = 200) -> None:
        self.final = False
        self.calls = 0
        self.status = status
        self.clock = ManualClock()
        self.hold = FinalStateHold(lambda: self.final, limit_s=limit_s, clock=self.clock)
        self.page = Route(lambda: Response(b"<html>", content_type="text/html"), public=True)
        self.routes = self.hold.routes({"/": self.page, STATUS_PATH: Route(self._status)})

    def _status(self) -> Response:
        self.calls += 1
        return Response(b'{"state": "%s"}' % (b"finished" if self.final else b"running"), status=self.status)

    def read(self) -> bytes:
        return self.routes[STATUS_PATH].handler().body

    def wait_in_thread(self) -> tuple[threading.Thread, list[float]]:
        waited: list[float] = []
        thread = threading.Thread(target=lambda: waited.append(self.hold.wait()), daemon=True)
        thread.start()
        return thread, waited


def test_routes_are_kept_and_the_status_route_still_answers():
    s = Status(limit_s=10)
    assert set(s.routes) == {"/", STATUS_PATH}
    assert s.routes["/"] is s.page  # only the status route is wrapped
    assert s.routes[STATUS_PATH].public is False  # and keeps its token rule
    assert s.read() == b'{"state": "running"}' and s.calls == 1
    assert FinalStateHold(lambda: True, limit_s=1).routes({"/": s.page}) == {"/": s.page}


def test_an_unwatched_run_never_waits():
    s = Status(limit_s=60)
    s.final = True
    assert not s.hold.watched()
    assert s.hold.wait() == 0.0


def test_a_run_that_did_not_finish_never_waits():
    s = Status(limit_s=60)
    s.read()  # a page watching, but the run was stopped, not finished
    assert not s.hold.watched()
    assert s.hold.wait() == 0.0


def test_a_watcher_that_already_read_the_final_state_is_not_waited_for():
    s = Status(limit_s=60)
    s.read()
    s.final = True
    s.read()  # e.g. fedgrid status at the finished event
    assert not s.hold.watched() and s.hold.wait() == 0.0


def test_the_wait_ends_with_the_watchers_read_of_the_final_state():
    s = Status(limit_s=60)
    s.read()  # the page, during the last round
    s.final = True
    assert s.hold.watched()
    thread, waited = s.wait_in_thread()
    assert s.read() == b'{"state": "finished"}'  # the page's next poll: the final state
    thread.join(timeout=10)
    assert not thread.is_alive() and waited == [0.0]  # the clock never moved: ended by the read
    assert not s.hold.watched() and s.hold.wait() == 0.0


def test_refused_reads_do_not_count_as_watching():
    s = Status(limit_s=60, status=500)
    s.read()
    s.final = True
    assert s.calls == 1 and not s.hold.watched()


def test_the_wait_is_bounded_by_limit_s():
    s = Status(limit_s=30.0)
    s.read()
    s.final = True
    thread, waited = s.wait_in_thread()  # nobody reads again
    asleep(s.clock)
    s.clock.advance(29.5)
    assert s.clock.sleepers() == 1 and thread.is_alive()
    s.clock.advance(0.5)
    thread.join(timeout=10)
    assert not thread.is_alive() and waited == [30.0]


def test_a_read_older_than_limit_s_is_no_watcher():
    s = Status(limit_s=1.0)
    s.read()
    s.final = True
    assert s.hold.watched()
    s.clock.advance(1.0)
    assert s.hold.watched()  # read exactly limit_s ago: still watching
    s.clock.advance(0.5)
    assert not s.hold.watched() and s.hold.wait() == 0.0


def test_release_ends_the_wait_at_once():
    s = Status(limit_s=60)
    s.read()
    s.final = True
    thread, waited = s.wait_in_thread()
    s.hold.release()  # a stop signal
    thread.join(timeout=10)
    assert not thread.is_alive() and waited == [0.0]
    assert s.hold.wait() == 0.0  # a later wait returns at once too


@pytest.mark.parametrize("limit_s", [-1.0, float("inf"), float("nan")])
def test_a_bad_limit_is_refused(limit_s):
    with pytest.raises(ValueError, match="limit_s must be a finite number at least 0"):
        FinalStateHold(lambda: False, limit_s=limit_s)


def test_a_zero_limit_never_waits():
    s = Status(limit_s=0.0)
    s.read()
    s.final = True
    assert s.hold.wait() == 0.0
