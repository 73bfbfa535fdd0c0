"""The membership keeps no dead sessions: silent ones are purged, the total is bounded, Joins
are logged at a bounded rate, a session is found from its token alone (issue 26), and restored
sessions get a restart grace. Time is a ManualClock the tests advance."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import pytest

from fedgrid.clock import ManualClock
from fedgrid.constants import LOG_BURST_LINES, MAX_SESSIONS, RETRY_MAX_WAIT_S
from fedgrid.errors import AuthenticationError, ResourceLimitError, SessionReplacedError
from fedgrid.events import EventLog
from fedgrid.server.membership import Membership
from fedgrid.server.remote_fleet import RESTART_GRACE_S, RemoteFleet
from fedgrid.server.wakeups import Wakeups
from fedgrid.types import ClientInfo


def _membership(heartbeat_s: float, max_sessions: int, clock: ManualClock | None = None) -> Membership:
    return Membership(
        Wakeups(threading.RLock(), clock=clock or ManualClock()),
        EventLog(),
        heartbeat_s,
        lambda record, why: None,
        max_sessions=max_sessions,
    )


def _anonymous() -> ClientInfo:
    return ClientInfo(client_id="", name="", num_examples=1)


def test_twenty_thousand_anonymous_joins_are_not_all_kept(caplog):
    membership = _membership(60.0, max_sessions=1_000)
    refused = []
    with caplog.at_level(logging.INFO, logger="fedgrid.server.membership"):
        for _ in range(20_000):
            try:
                membership.join(_anonymous())
            except ResourceLimitError as exc:
                refused.append(str(exc))
    assert len(membership.records) == 1_000 and len(refused) == 19_000
    assert refused[0] == "coordinator full: 1000 sessions (limit 1000); retry later"
    # 216 bytes a Join on today's main: 20,000 lines. Now the first few, and summaries.
    lines = [r.getMessage() for r in caplog.records if r.name == "fedgrid.server.membership"]
    assert len(lines) <= 2 * LOG_BURST_LINES and sum("joined as" in line for line in lines) == LOG_BURST_LINES


def test_silent_sessions_are_purged_and_a_rejoin_always_fits():
    clock = ManualClock()
    membership = _membership(1.0, max_sessions=3, clock=clock)
    named = {n: membership.join(ClientInfo(client_id="", name=n, num_examples=1)) for n in ("a", "b", "c")}
    with pytest.raises(ResourceLimitError, match="coordinator full: 3 sessions"):
        membership.join(_anonymous())
    # A client restarting under its name replaces its session: never refused for room.
    info, token = membership.join(ClientInfo(client_id="", name="a", num_examples=1))
    assert membership.session(token).info.client_id == info.client_id
    clock.advance(2.9)  # "a" called at 0, "b" and "c" never: none silent for 3 intervals yet
    with pytest.raises(ResourceLimitError):
        membership.join(_anonymous())
    clock.advance(0.2)
    membership.join(_anonymous())  # "b" and "c" purged to make room; "a" too (silent since 0)
    assert len(membership.records) == 1
    with pytest.raises(AuthenticationError, match="bad session token: it names no session"):
        membership.session(named["b"][1])  # purged with its session: the token is gone too


def test_with_the_default_bound_silent_sessions_go_as_new_ones_come():
    clock = ManualClock()
    membership = _membership(1.0, max_sessions=MAX_SESSIONS, clock=clock)  # silent after 3 s
    most = 0
    for _ in range(20_000):  # the flood: 20,000 Joins, one a millisecond
        membership.join(_anonymous())
        clock.advance(0.001)
        most = max(most, len(membership.records))
    # Joins purge at least once a heartbeat interval: never more than 3 s + 1 s of them kept.
    assert 3_000 <= most <= 4_001 and len(membership.records) <= 4_001


def test_a_session_is_found_from_its_token_alone():
    membership = _membership(60.0, max_sessions=10)
    info, token = membership.join(ClientInfo(client_id="", name="site-1", num_examples=1))
    assert membership.session(token).info == info
    with pytest.raises(AuthenticationError, match="no session token: Join first"):
        membership.session("")
    with pytest.raises(AuthenticationError, match="bad session token: it names no session"):
        membership.session(token + "x")
    # Replaced by a newer Join of its identity: its token tells it so (issue 27's conflict).
    newer, newer_token = membership.join(ClientInfo(client_id="", name="site-1", num_examples=1))
    with pytest.raises(SessionReplacedError, match="replaced by a newer session"):
        membership.session(token)
    assert membership.session(newer_token).info == newer
    with membership.lock:
        membership.remove(newer.client_id, "left")
    with pytest.raises(AuthenticationError, match="it names no session"):
        membership.session(newer_token)


def test_restored_sessions_get_the_restart_grace_before_silence_counts():
    """A restarted coordinator gives the clients it restored the retry backoff's cap plus
    ``RESTART_GRACE_S`` (they may be asleep in backoff) before their silence starts to count."""
    clock = ManualClock()
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=5), clock=clock)  # silent after 15 s
    fleet.join(ClientInfo(client_id="", name="site-1", num_examples=1))
    state = fleet.state_dict()
    clock.advance(100.0)  # the coordinator was down a while: the client's last call is long past
    restored = RemoteFleet(heartbeat_interval=timedelta(seconds=5), clock=clock)
    restored.load_state_dict(state)
    grace = RETRY_MAX_WAIT_S + RESTART_GRACE_S
    clock.advance(grace + 15.0)  # silent exactly the limit, counted from the end of the grace
    assert [c.name for c in restored.live_clients()] == ["site-1"]
    clock.advance(0.5)
    assert restored.live_clients() == []
    fleet.close()
    restored.close()
