"""The registry keeps no dead sessions: silent ones are purged, the total is bounded, Joins
are logged at a bounded rate, and a session is found from its token alone (issue 26)."""

from __future__ import annotations

import logging
import threading

import pytest

from fedgrid.constants import LOG_BURST_LINES, MAX_SESSIONS
from fedgrid.errors import AuthenticationError, ResourceLimitError, SessionReplacedError
from fedgrid.events import EventLog
from fedgrid.server.registry import Registry
from fedgrid.server.wakeups import Wakeups
from fedgrid.types import ClientInfo

from harness import wait_until


def _registry(heartbeat_s: float, max_sessions: int) -> Registry:
    return Registry(
        Wakeups(threading.RLock()),
        EventLog(),
        heartbeat_s,
        lambda record, why: None,
        max_sessions=max_sessions,
    )


def _anonymous() -> ClientInfo:
    return ClientInfo(client_id="", name="", num_examples=1)


def test_twenty_thousand_anonymous_joins_are_not_all_kept(caplog):
    registry = _registry(60.0, max_sessions=1_000)
    refused = []
    with caplog.at_level(logging.INFO, logger="fedgrid.server.registry"):
        for _ in range(20_000):
            try:
                registry.join(_anonymous())
            except ResourceLimitError as exc:
                refused.append(str(exc))
    assert len(registry.records) == 1_000 and len(refused) == 19_000
    assert refused[0] == "coordinator full: 1000 sessions (limit 1000); retry later"
    # 216 bytes a Join on today's main: 20,000 lines. Now the first few, and summaries.
    lines = [r.getMessage() for r in caplog.records if r.name == "fedgrid.server.registry"]
    assert len(lines) <= 2 * LOG_BURST_LINES and sum("joined as" in line for line in lines) == LOG_BURST_LINES


def test_silent_sessions_are_purged_and_a_rejoin_always_fits():
    registry = _registry(0.05, max_sessions=3)
    named = {n: registry.join(ClientInfo(client_id="", name=n, num_examples=1)) for n in ("a", "b", "c")}
    with pytest.raises(ResourceLimitError, match="coordinator full: 3 sessions"):
        registry.join(_anonymous())
    # A client restarting under its name replaces its session: never refused for room.
    info, token = registry.join(ClientInfo(client_id="", name="a", num_examples=1))
    assert registry.session(token).info.client_id == info.client_id

    # Silent for SILENCE_INTERVALS heartbeat intervals: purged, and room is made for new ones.
    def purged() -> bool:
        with registry.lock:
            registry.purge()
            return not registry.records

    wait_until(purged, timeout=10, what="the silent sessions purged")
    registry.join(_anonymous())
    assert len(registry.records) == 1
    with pytest.raises(AuthenticationError, match="bad session token: it names no session"):
        registry.session(named["b"][1])  # purged with its session: the token is gone too


def test_with_the_default_bound_silent_sessions_go_as_new_ones_come():
    registry = _registry(0.05, max_sessions=MAX_SESSIONS)  # silent after 0.15 s
    most = 0
    for _ in range(20_000):  # the flood: seconds of Joins on any machine
        registry.join(_anonymous())
        most = max(most, len(registry.records))
    assert most < 20_000 / 2  # purged at least once a heartbeat interval by the Joins themselves


def test_a_session_is_found_from_its_token_alone():
    registry = _registry(60.0, max_sessions=10)
    info, token = registry.join(ClientInfo(client_id="", name="site-1", num_examples=1))
    assert registry.session(token).info == info
    with pytest.raises(AuthenticationError, match="no session token: Join first"):
        registry.session("")
    with pytest.raises(AuthenticationError, match="bad session token: it names no session"):
        registry.session(token + "x")
    # Replaced by a newer Join of its identity: its token tells it so (issue 27's conflict).
    newer, newer_token = registry.join(ClientInfo(client_id="", name="site-1", num_examples=1))
    with pytest.raises(SessionReplacedError, match="replaced by a newer session"):
        registry.session(token)
    assert registry.session(newer_token).info == newer
    with registry.lock:
        registry.remove(newer.client_id, "left")
    with pytest.raises(AuthenticationError, match="it names no session"):
        registry.session(newer_token)
