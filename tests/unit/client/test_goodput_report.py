"""The runtime's time split in each fit result (client/runtime.py, client/task_feed.py), on a fake clock."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import pytest
import torch

from fedgrid.client import runtime
from fedgrid.client.api import Client, FitOutput
from fedgrid.client.session import AsyncSession, Session
from fedgrid.client.task_feed import TaskStep
from fedgrid.client.timeline import COMPUTE, SPLIT_KEYS, Split, Timeline, with_split
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto.assembly import MAX_METRICS
from fedgrid.telemetry import SPLIT_KEYS as ROUND_SPLIT_KEYS

DOWNLOAD_S, UPLOAD_S, FIT_S, POLL_S = 3.0, 2.0, 5.0, 1.0


class Clock:
    """Seconds that pass only when a fake call says so."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeConn:
    """What ``TaskStep`` calls, each transfer taking its fixed seconds on ``clock``."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.bytes_down = self.bytes_up = 0
        self.upload_attempts: list[object] = []
        self.uploaded: list[dict[str, float]] = []
        self.stop = threading.Event()

    def fetch_model(self, task_id: str):
        self.clock.t += DOWNLOAD_S
        return OrderedDict(w=torch.zeros(2))

    def upload(
        self,
        task_id,
        server_round,
        update,
        num_examples,
        metrics,
        *,
        codec,
        global_state,
        task_config=None,
        on_encoded=None,
    ) -> int:
        if on_encoded is not None:
            on_encoded()
        self.clock.t += UPLOAD_S
        self.uploaded.append(dict(metrics))
        return 8


class Trainer(Client):
    """Each fit takes ``FIT_S``; after round 1's, training goes on 1.5 s in the background
    (as overlapped DiLoCo's does), while the upload runs."""

    name = "trainer"

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.__dict__["_timeline"] = Timeline(clock)

    def fit(self, state, ins):
        self.clock.t += FIT_S
        if ins.round == 1:
            self.timeline.add(COMPUTE, self.clock.t, self.clock.t + 1.5)
        return FitOutput(OrderedDict(state), num_examples=4, metrics={"loss": 0.5})


class FakeFeed:
    """Two fit tasks, each after a poll of ``POLL_S``."""

    def __init__(self, conn: FakeConn, client: Client) -> None:
        self.conn, self.client = conn, client

    def emit(self, kind: str, **fields: object) -> None:
        pass

    def __iter__(self):
        for r in (1, 2):
            self.conn.clock.t += POLL_S
            yield TaskStep(
                self.conn,  # type: ignore[arg-type]
                pb.Task(task_id=f"t{r}", round=r, kind=pb.FIT, deadline_s=60),
                timeline=self.client.timeline,
            )


def test_each_fit_result_carries_the_exact_split_of_its_window(caplog):
    clock = Clock()
    client = Trainer(clock)
    conn = FakeConn(clock)
    with caplog.at_level(logging.INFO, logger="fedgrid.client.runtime"):
        rounds = runtime._serve(FakeFeed(conn, client), None, None, since=0.0)  # type: ignore[arg-type]
    assert rounds == 2
    first, second = conn.uploaded
    # Window [0, 9]: poll 1, download 3, fit 5.
    assert {k: first[k] for k in SPLIT_KEYS} == {
        "wall_s": 9.0,
        "compute_s": 5.0,
        "comm_s": 3.0,
        "wait_s": 1.0,
        "transfer_s": 3.0,
        "utilization": 5.0 / 9.0,
    }
    # Window [9, 20]: upload 2 (1.5 s of it under background compute), poll 1, download 3, fit 5.
    assert {k: second[k] for k in SPLIT_KEYS} == {
        "wall_s": 11.0,
        "compute_s": 6.5,
        "comm_s": 3.5,
        "wait_s": 1.0,
        "transfer_s": 5.0,
        "utilization": 6.5 / 11.0,
    }
    assert first["loss"] == second["loss"] == 0.5
    assert (
        "round 2: trained on 4 examples in 11.0 s: compute 6.5 s, comm 3.5 s, wait 1.0 s (utilization 0.59), "
        "loss 0.5000"
    ) in caplog.messages


def test_a_result_with_its_own_split_keeps_it():
    own = dict.fromkeys(SPLIT_KEYS, 1.0)
    split = Split(wall_s=4.0, compute_s=2.0, comm_s=1.0, wait_s=1.0, transfer_s=1.0)
    assert with_split({**own, "loss": 0.1}, split) == {**own, "loss": 0.1}
    assert with_split({"loss": 0.1, "wall_s": 9.0}, split) == {"loss": 0.1, **split.metrics()}


def test_the_split_fits_the_coordinators_metric_bounds():
    assert set(SPLIT_KEYS) == set(ROUND_SPLIT_KEYS) == set(Split(1, 1, 0, 0, 0).metrics())
    assert MAX_METRICS >= 64 + len(SPLIT_KEYS)  # the application keeps its 64


def test_a_sessions_host_says_what_is_compute():
    session = Session("127.0.0.1:1")  # never joined: only its timeline is used
    aio = AsyncSession(Session("127.0.0.1:1"))
    try:
        for host in (session, aio):
            timeline = host.session.timeline if isinstance(host, AsyncSession) else host.timeline
            start = timeline.clock()
            with host.compute():
                inside = timeline.clock()
                while timeline.clock() - inside < 0.01:  # the host's training
                    pass
            end = timeline.clock()
            split = timeline.split(start, end)
            assert (
                split.compute_s >= 0.01
                and split.comm_s == 0
                and split.compute_s + split.wait_s == pytest.approx(split.wall_s)
            )
    finally:
        session.close()
        aio.session.close()
