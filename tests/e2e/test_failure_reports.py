"""Failures are reported, not waited out: a client whose fit raises reports it and carries
on; a client that stops or is terminated leaves at once; a restarted client replaces its
old session; a client that heartbeats but never delivers is benched after one deadline."""

from __future__ import annotations

import signal
from datetime import timedelta

import grpc
import pytest
import torch

from fedgrid.client import start_client as start  # harness.start_client starts a process
from fedgrid.client.runtime import Connection
from fedgrid.clock import ManualClock
from fedgrid.errors import AuthenticationError, InvalidUpdateError, StaleTaskError
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.types import ClientInfo, FitIns

from clocked import asleep, run_out
from harness import InProcessCoordinator, start_client, wait_until
from harness_clients import Named

ROUND_TIMEOUT_S = 120.0  # far longer than any of these rounds may take: closing early is the point


class FailsFirst(Named):
    """``fit`` raises in its first round, then trains as ``Named``."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.calls = 0

    def fit(self, state, ins):
        self.calls += 1
        if self.calls == 1:
            raise ValueError("batch 3 has no labels")
        return super().fit(state, ins)


def test_fit_error_is_reported_at_once_and_the_client_carries_on(small_state):
    server = InProcessCoordinator(small_state)
    client = FailsFirst("flaky")
    handle = start(client, server.address, poll_wait_s=1.0)
    try:
        wait_until(lambda: len(server.fleet.live_clients()) == 1, timeout=30, what="client to join")
        server.open_round(timeout_s=ROUND_TIMEOUT_S)
        outcome = server.wait_round(timeout=60)
        assert outcome.results == [] and outcome.closed_by == "all"  # not by its deadline
        assert [f.reason for f in outcome.failures] == ["client reported: ValueError: batch 3 has no labels"]
        server.open_round(timeout_s=ROUND_TIMEOUT_S, server_round=2)
        outcome = server.wait_round(timeout=60)
        assert [r.client.name for r in outcome.results] == ["flaky"] and outcome.failures == []
        for name, tensor in small_state.items():
            assert torch.equal(outcome.results[0].state[name], tensor + 1)
        assert handle.running and client.calls == 2
    finally:
        handle.stop()
        server.stop()


class DivergesFirst(Named):
    """Returns NaN weights in its first round, an infinite loss in its second, then trains."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.calls = 0

    def fit(self, state, ins):
        self.calls += 1
        out = super().fit(state, ins)
        if self.calls == 1:
            out.state["layer.weight"] = torch.full_like(out.state["layer.weight"], float("nan"))
        if self.calls == 2:
            return type(out)(out.state, out.num_examples, {"loss": float("inf")})
        return out


def test_a_diverged_update_is_reported_and_the_client_carries_on(small_state):
    """The coordinator would refuse it, and a refused upload ends the client: the SDK checks
    first, reports the round's failure, and trains the next round."""
    server = InProcessCoordinator(small_state)
    client = DivergesFirst("diverging")
    handle = start(client, server.address, poll_wait_s=1.0)
    try:
        wait_until(lambda: len(server.fleet.live_clients()) == 1, timeout=30, what="client to join")
        reasons = []
        for r in (1, 2):
            server.open_round(timeout_s=ROUND_TIMEOUT_S, server_round=r)
            outcome = server.wait_round(timeout=60)
            assert outcome.results == [] and outcome.closed_by == "all"
            reasons += [f.reason for f in outcome.failures]
        assert reasons == [
            "client reported: InvalidUpdateError: tensor 'layer.weight': contains NaN",
            "client reported: InvalidUpdateError: metric 'loss' is inf",
        ]
        server.open_round(timeout_s=ROUND_TIMEOUT_S, server_round=3)
        outcome = server.wait_round(timeout=60)
        assert [r.client.name for r in outcome.results] == ["diverging"] and handle.running
    finally:
        handle.stop()
        server.stop()


def test_stopped_client_leaves_at_once(small_state):
    server = InProcessCoordinator(small_state, heartbeat_s=60.0)  # silence would take 180 s to notice
    handle = start(Named("leaver"), server.address, poll_wait_s=1.0)
    try:
        wait_until(lambda: len(server.fleet.live_clients()) == 1, timeout=30, what="client to join")
        handle.stop()
        assert handle.join(timeout=30).rounds == 0
        assert server.fleet.live_clients() == []  # told, not timed out
    finally:
        server.stop()


def test_terminated_client_process_leaves_its_round_at_once(small_state, tmp_path, monkeypatch):
    markers = tmp_path / "markers"
    markers.mkdir()
    for key, value in {"SLOW_APP_MARKER_DIR": str(markers), "SLOW_APP_FIT_S": "300"}.items():
        monkeypatch.setenv(key, value)
    server = InProcessCoordinator(small_state, heartbeat_s=60.0)
    proc = start_client(server.address, tmp_path / "c.log", "--app", "slow_app:client", "--partition", "0/1")
    try:
        wait_until(lambda: len(server.fleet.live_clients()) == 1, timeout=60, what="client to join")
        server.open_round(timeout_s=ROUND_TIMEOUT_S)
        wait_until(lambda: (markers / "fit-0-1").exists(), timeout=60, what="client mid-fit")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM, (tmp_path / "c.log").read_text()[-2000:]
        outcome = server.wait_round(timeout=30)
        assert outcome.closed_by == "all" and outcome.results == []
        assert [f.reason for f in outcome.failures] == ["client left: KeyboardInterrupt: SIGTERM"]
        assert server.fleet.live_clients() == []
        assert "stopped; left the federation" in (tmp_path / "c.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()


def test_rejoin_under_the_same_name_replaces_the_old_session(small_state):
    server = InProcessCoordinator(small_state)
    old, new = Connection(server.address), Connection(server.address)
    try:
        old.join(Named("site-7"))
        new.join(Named("site-7"))
        assert [c.client_id for c in server.fleet.live_clients()] == [new.client_id]
        with pytest.raises(grpc.RpcError) as err:
            old.heartbeat()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert new.heartbeat() > 0
    finally:
        old.close()
        new.close()
        server.stop()


def _join(fleet: RemoteFleet, name: str) -> tuple[ClientInfo, str]:
    return fleet.join(ClientInfo(client_id="", name=name, num_examples=1))


def test_a_client_that_never_delivers_costs_one_deadline_then_is_benched(small_state):
    clock = ManualClock()
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60), clock=clock)
    mute, mute_token = _join(fleet, "mute")
    other, other_token = _join(fleet, "other")
    outcome = run_out(
        clock,
        lambda: fleet.fit_round(
            server_round=1,
            global_state=small_state,
            assignments=[(mute, FitIns(round=1)), (other, FitIns(round=1))],
            timeout=timedelta(seconds=30),
        ),
    )
    assert outcome.closed_by == "deadline" and len(outcome.failures) == 2 and clock.now() == 30.0
    assert {f.reason for f in outcome.failures} == {"missed the round deadline of 30.0s"}
    fleet.committed(1)
    # Both heartbeat, neither delivered: both are live, neither is selectable.
    for client, token in ((mute, mute_token), (other, other_token)):
        fleet.heartbeat(client.client_id, token)
    assert {c.name for c in fleet.live_clients()} == {"mute", "other"}
    with pytest.raises(TimeoutError, match=r"0 live clients .* \(2 more benched after missing a deadline\)"):
        run_out(clock, lambda: fleet.wait_for_clients(min_clients=1, timeout=timedelta(seconds=20)))
    # The benching survives a restart of the coordinator.
    restored = RemoteFleet(heartbeat_interval=timedelta(seconds=60), clock=clock)
    restored.load_state_dict(fleet.state_dict())
    with pytest.raises(TimeoutError):
        run_out(clock, lambda: restored.wait_for_clients(min_clients=1, timeout=timedelta(seconds=10)))
    # "other" finishes its late task (a failure report for it, or an upload): selectable again.
    task = f"{fleet.run_id[:12]}-r1-fit"
    with pytest.raises(StaleTaskError):
        fleet.report_failure(other.client_id, other_token, task, "out of memory")
    assert [c.name for c in fleet.wait_for_clients(min_clients=1, timeout=timedelta(seconds=0))] == ["other"]
    fleet.close()
    restored.close()


def test_bad_reports_change_nothing(small_state):
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    info, token = _join(fleet, "c")
    import threading

    result = []
    t = threading.Thread(
        target=lambda: result.append(
            fleet.fit_round(
                server_round=1,
                global_state=small_state,
                assignments=[(info, FitIns(round=1))],
                timeout=timedelta(seconds=30),
            )
        )
    )
    t.start()
    wait_until(lambda: fleet.current_round is not None, timeout=10, what="round to open")
    task = fleet.current_round.task_id
    with pytest.raises(InvalidUpdateError, match="reason: 1001 characters, at most 1000"):
        fleet.report_failure(info.client_id, token, task, "x" * 1001)
    with pytest.raises(AuthenticationError):
        fleet.report_failure(info.client_id, "wrong-token", task, "boom")
    with pytest.raises(StaleTaskError):
        fleet.report_failure(info.client_id, token, "no-such-task", "boom")
    with pytest.raises(InvalidUpdateError):
        fleet.leave(info.client_id, token, "y" * 5000)
    assert fleet.current_round.failures == {} and [c.client_id for c in fleet.live_clients()] == [
        info.client_id
    ]
    fleet.report_failure(
        info.client_id, token, task, "boom\n\x1b[31m"
    )  # control characters are data, logged escaped
    t.join(timeout=10)
    assert [f.reason for f in result[0].failures] == ["client reported: boom\n\x1b[31m"]
    fleet.close()


def test_a_client_holding_a_long_poll_is_alive_without_heartbeats():
    import asyncio

    clock = ManualClock()
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=5), clock=clock)  # silent for 15 s: gone
    info, token = _join(fleet, "poller")

    async def main() -> tuple[list[str], float, list[str], list[str]]:
        poll = asyncio.ensure_future(fleet.poll_async(info.client_id, token, 60.0))
        await asyncio.to_thread(asleep, clock)  # the poll waits, until 60.0
        clock.advance(30.0)  # twice the silence limit, no heartbeat: the held poll counts
        during = [c.name for c in fleet.live_clients()]
        clock.advance(30.0)
        answer = await poll
        clock.advance(15.0)  # silent since the poll returned at 60.0, but not longer than 15 s
        still = [c.name for c in fleet.live_clients()]
        clock.advance(0.5)
        return during, answer.retry_after_s, still, [c.name for c in fleet.live_clients()]

    during, retry_after_s, still, after = asyncio.run(main())
    assert during == ["poller"] and retry_after_s == 0.0 and clock.now() == 75.5
    assert still == ["poller"] and after == []  # silence counts again once the poll returned, from then
    fleet.close()
