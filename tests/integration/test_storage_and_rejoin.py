"""A full disk under the spill is UNAVAILABLE to the client and stops the fleet's round; a client
that rejoins while its task is open takes that task over (issue 26, item 4)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import timedelta

import grpc
import pytest
import torch

from fedgrid.client.rpc import RpcFailed
from fedgrid.client.runtime import Connection
from fedgrid.clock import ManualClock
from fedgrid.errors import StorageError
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.types import FitIns

from clocked import asleep
from full_disk import full_disk
from harness import wait_until
from harness_clients import Named

STATE = OrderedDict(w=torch.arange(6.0), b=torch.ones(2))


def _serve(fleet: RemoteFleet) -> Coordinator:
    return Coordinator("127.0.0.1:0", fleet, max_workers=8).start()


def _round(fleet: RemoteFleet, infos, outcome: list, *, timeout_s: float = 60.0) -> threading.Thread:
    def run() -> None:
        try:
            outcome.append(
                fleet.fit_round(
                    server_round=1,
                    global_state=STATE,
                    assignments=[(info, FitIns(round=1)) for info in infos],
                    timeout=timedelta(seconds=timeout_s),
                )
            )
        except Exception as exc:  # noqa: BLE001 - the test reads what the round raised
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(lambda: fleet.current_round is not None, timeout=10, what="the round to open")
    return thread


def test_a_full_disk_is_unavailable_to_the_client_and_stops_the_round(tmp_path):
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60), spill_dir=tmp_path / "state" / "updates")
    server = _serve(fleet)
    conn = Connection(server.address, retry_max_elapsed=0.5, retry_max_wait=0.1)
    try:
        conn.join(Named("site-0"))
        infos = fleet.wait_for_clients(min_clients=1, timeout=timedelta(seconds=10))
        outcome: list = []
        thread = _round(fleet, infos, outcome)
        task = conn.poll(5).task
        update = OrderedDict((k, v + 1) for k, v in conn.download(task.task_id).items())
        with full_disk(tmp_path / "state"), pytest.raises(RpcFailed) as info:
            conn.upload(task.task_id, task.round, update, 3, {})
        assert info.value.code == grpc.StatusCode.UNAVAILABLE  # transient: the client waits and retries
        assert "storage error" in info.value.details and "No space left on device" in info.value.details
        thread.join(timeout=30)
        assert isinstance(outcome[0], StorageError)  # not a round of failed clients
        assert str(outcome[0]) == info.value.details and "MiB free of" in str(outcome[0])
        assert not list((tmp_path / "state" / "updates").rglob("*.part"))
    finally:
        conn.close()
        server.stop(grace=0.5)
        fleet.close()


def test_a_client_that_rejoins_mid_round_takes_its_task_over(tmp_path):
    # The first session falls silent (dropped, its task failed) before the restarted process
    # joins; the round is still open (the other client has not sent). The fleet's clock is the
    # test's: silence is 15 s of it (three 5 s heartbeat intervals), and only "other" heartbeats.
    clock = ManualClock()
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=5), clock=clock)
    server = _serve(fleet)
    first = Connection(server.address, retry_max_elapsed=2, retry_max_wait=0.1)
    other = Connection(server.address, retry_max_elapsed=2, retry_max_wait=0.1)
    restarted = Connection(server.address, retry_max_elapsed=2, retry_max_wait=0.1)
    try:
        first.join(Named("region-b"))
        other.join(Named("region-a"))
        infos = fleet.wait_for_clients(min_clients=2, timeout=timedelta(seconds=10))
        outcome: list = []
        thread = _round(fleet, infos, outcome)
        task = first.poll(5).task
        old_id = first.client_id
        first.close()  # killed: no leave, no more heartbeats
        asleep(clock)  # the round waits for results, checking silence every 2.5 s
        clock.advance(10.0)
        other.heartbeat()  # at 10.0
        assert old_id not in fleet.current_round.failures  # silent for 10 s: not yet gone
        clock.advance(6.0)  # 16.0: "first" silent for 16 s, "other" for 6 s
        wait_until(
            lambda: old_id in fleet.current_round.failures, timeout=10, what="the silent session to fail"
        )
        assert fleet.current_round.failures[old_id].reason == "client went silent (no heartbeat)"
        restarted.join(Named("region-b"))
        rnd = fleet.current_round
        assert restarted.client_id in rnd.assignments and old_id not in rnd.assignments
        assert old_id not in rnd.failures
        again = restarted.poll(5).task
        assert (again.task_id, again.round) == (task.task_id, task.round)  # the same task, the same seed
        for conn, plus in ((restarted, 2.0), (other, 1.0)):
            t = conn.poll(5).task if conn is other else again
            update = OrderedDict((k, v + plus) for k, v in conn.download(t.task_id).items())
            conn.upload(t.task_id, t.round, update, 1, {})
        thread.join(timeout=30)
        result = outcome[0]
        assert sorted(r.client.name for r in result.results) == ["region-a", "region-b"]
        assert result.failures == []
    finally:
        for conn in (other, restarted):
            conn.close()
        server.stop(grace=0.5)
        fleet.close()
