"""The membership's identity rule: the newest Join of an identity takes its place; a replaced
session that calls again is a conflict (two processes), told so and counted once; a session
that never calls again (a crashed process) is not."""

from __future__ import annotations

import threading

import pytest

from fedgrid.errors import SESSION_REPLACED, AuthenticationError, SessionReplacedError
from fedgrid.events import EventLog
from fedgrid.server import membership as membership_module
from fedgrid.server.membership import Membership
from fedgrid.server.wakeups import Wakeups
from fedgrid.types import ClientInfo


@pytest.fixture
def membership() -> tuple[Membership, list]:
    events = EventLog()
    seen: list = []
    events.subscribe(seen.append)
    return Membership(Wakeups(threading.RLock()), events, 5.0, on_remove=lambda record, reason: None), seen


def _join(membership: Membership, name: str) -> tuple[str, str]:
    info, token = membership.join(ClientInfo(client_id="", name=name, num_examples=3))
    return info.client_id, token


def test_a_replaced_session_that_calls_again_is_told_and_counted_once(membership):
    reg, seen = membership
    old, old_token = _join(reg, "digits-0000/2")
    new, new_token = _join(reg, "digits-0000/2")
    assert list(reg.records) == [new] and reg.conflicts == {}  # no call yet: maybe a restart
    for _ in range(3):  # every later call of the old process is told; the conflict counts once
        with pytest.raises(SessionReplacedError) as err:
            reg.authenticate(old, old_token)
        assert err.value.reason == SESSION_REPLACED
        assert "'digits-0000/2'" in str(err.value) and "the same --partition" in str(err.value)
    assert reg.conflicts == {"digits-0000/2": 1}
    assert [
        (e.event, e.fields["client"], e.fields["by"]) for e in seen if e.event == "identity_conflict"
    ] == [("identity_conflict", old, new)]
    assert reg.authenticate(new, new_token).info.client_id == new  # the newer session is untouched
    assert reg.conflict_note() == (
        ", 1 identity conflict ('digits-0000/2': two processes with one --partition or certificate)"
    )


def test_a_session_replaced_after_a_crash_is_no_conflict(membership):
    reg, seen = membership
    _join(reg, "site-a")
    new, token = _join(reg, "site-a")  # the restarted process; the crashed one never calls again
    assert reg.authenticate(new, token).info.name == "site-a"
    assert reg.conflicts == {} and reg.conflict_note() == ""
    assert not [e for e in seen if e.event == "identity_conflict"]


def test_only_the_replaced_sessions_own_token_hears_why(membership):
    reg, _ = membership
    old, _token = _join(reg, "alice")
    _join(reg, "alice")
    with pytest.raises(AuthenticationError) as err:
        reg.authenticate(old, "a guessed token")
    assert type(err.value) is AuthenticationError and "unknown client" in str(err.value)
    assert reg.conflicts == {}


def test_replaced_sessions_are_remembered_up_to_a_bound(membership, monkeypatch):
    monkeypatch.setattr(membership_module, "MAX_REPLACED", 2)
    reg, _ = membership
    sessions = [_join(reg, "bob") for _ in range(4)]  # three replaced; the oldest is forgotten
    with pytest.raises(AuthenticationError) as err:
        reg.authenticate(*sessions[0])
    assert type(err.value) is AuthenticationError
    for replaced in sessions[1:3]:
        with pytest.raises(SessionReplacedError):
            reg.authenticate(*replaced)
    assert reg.conflicts == {"bob": 2}
    assert "2 identity conflicts ('bob':" in reg.conflict_note()
