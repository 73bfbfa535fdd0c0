"""Semi-asynchronous rounds (``min_quorum``) over a real in-process coordinator: a slow worker
never holds a round past its grace window, its late result is merged with its staleness
weight against the model it trained from, and a result staler than ``max_staleness`` is
refused with a status that names its staleness. The fleet's clock is the test's: a grace window
passes when the test advances it, once the round sleeps on it."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from datetime import timedelta

import grpc
import pytest
import torch

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.client import Client, FitOutput, start_client
from fedgrid.client.rpc import RpcFailed
from fedgrid.client.runtime import Connection
from fedgrid.clock import ManualClock
from fedgrid.events import EventLog
from fedgrid.fleet.base import Quorum
from fedgrid.server.engine import RoundEngine
from fedgrid.server.influence import Influence
from fedgrid.server.parts import RoundRules, RunIO, Schedule
from fedgrid.types import FitIns

from clocked import Call
from harness import InProcessCoordinator, wait_until
from harness_clients import Named

GRACE_S = 0.3


class Stepper(Client):
    """Returns the model it was sent plus ``step`` (``num_examples`` examples); its n-th fit
    first waits for ``gates[n]`` (none: at once), so a test decides when each result lands."""

    def __init__(self, name: str, step: float, num_examples: int, gates: list[threading.Event]) -> None:
        self.name, self.step, self._n, self.gates = name, step, num_examples, gates
        self.fits = 0

    @property
    def num_examples(self) -> int:
        return self._n

    def fit(self, state, ins):
        gate = self.gates[self.fits] if self.fits < len(self.gates) else None
        self.fits += 1
        if gate is not None:
            gate.wait(60)
        return FitOutput(OrderedDict((k, v + self.step) for k, v in state.items()), num_examples=self._n)


class Run:
    """An engine (FedAvg, ``quorum``) over an in-process coordinator with a fast and a slow
    worker; the test drives it round by round and reads its events."""

    def __init__(
        self,
        quorum: Quorum,
        slow_gates: list[threading.Event],
        *,
        clients: list[Stepper] | None = None,
        influence: Influence | None = None,
    ) -> None:
        self.initial = OrderedDict(w=torch.tensor([0.0, 1.0, 2.0]))
        self.quorum = quorum
        self.clock = ManualClock()
        self.server = InProcessCoordinator(self.initial, heartbeat_s=5.0, clock=self.clock)
        self.events: list[tuple[str, dict]] = []
        log = EventLog()
        log.subscribe(lambda e: self.events.append((e.event, dict(e.fields))))
        self.server.fleet.events = log
        for part in (self.server.fleet.uploads, self.server.fleet.phases):
            part.events = log
        strategy = FedAvg()
        strategy.initialize(initial_state=self.initial)
        self.engine = RoundEngine(
            strategy=strategy,
            fleet=self.server.fleet,
            schedule=Schedule(
                rounds=10,
                min_clients=1,
                round_timeout=timedelta(seconds=60),
                join_timeout=timedelta(seconds=30),
            ),
            rules=RoundRules(
                quorum=quorum,
                # The slow worker steps 10x as far as the fast one, exactly the default distance
                # bound: this test is about staleness weights (tests/unit/server/test_influence.py
                # bounds late results).
                influence=Influence(max_update_ratio=0) if influence is None else influence,
            ),
            io=RunIO(
                events=log,
            ),
        )
        self.fast = Stepper("fast", 1.0, 1, [])
        self.slow = Stepper("slow", 10.0, 4, slow_gates)
        self.clients = [self.fast, self.slow] if clients is None else clients
        self.handles = [start_client(c, self.server.address, poll_wait_s=1.0) for c in self.clients]
        wait_until(
            lambda: len(self.server.fleet.live_clients()) == len(self.clients),
            timeout=30,
            what="clients to join",
        )

    def round(self, r: int) -> torch.Tensor:
        """Runs round ``r``; once it reached its quorum and sleeps until its grace ends, advances
        the clock by the grace (nothing else moves it: deadlines and silence never pass)."""
        call = Call(lambda: self.engine.commit(self.engine.run_round(r)))
        wait_until(
            lambda: call.done() or self._in_grace(r),
            timeout=30,
            what=f"round {r} to close or reach its quorum",
        )
        if not call.done():
            self.clock.advance(self.quorum.grace_s)
        call.result(timeout=30)
        return self.engine.strategy.global_state["w"].clone()

    def _in_grace(self, r: int) -> bool:
        rnd = self.server.fleet.current_round
        return (
            rnd is not None
            and rnd.server_round == r
            and rnd.quorum_at is not None
            and rnd.quorum_at + self.quorum.grace_s in self.clock.deadlines()
        )

    def of(self, name: str) -> list[dict]:
        return [fields for event, fields in self.events if event == name]

    def close(self) -> None:
        self.server.fleet.finish(timeout=timedelta(seconds=10))
        for handle in self.handles:
            handle.join(timeout=30)
        self.server.stop()


def test_slow_worker_never_holds_a_round_and_its_late_result_gets_its_staleness_weight():
    gate = threading.Event()
    run = Run(Quorum(min_quorum=1, grace_s=GRACE_S, max_staleness=4), [gate, threading.Event()])
    try:
        g0 = run.initial["w"]
        g1 = run.round(1)  # both selected; closes at the fast one's result, the slow one keeps its task
        g2 = run.round(2)  # the slow one is busy: not selected
        torch.testing.assert_close(g1, g0 + 1, rtol=0, atol=0)
        torch.testing.assert_close(g2, g0 + 2, rtol=0, atol=0)
        gate.set()  # the slow worker's round-1 result lands now, between rounds: merged into round 3
        wait_until(
            lambda: any(f.get("late") for f in run.of("update_accepted")), timeout=30, what="late result"
        )
        g3 = run.round(3)

        closed = [f for f in run.of("round_closed") if f["phase"] == "fit"]
        assert [(f["round"], f["reason"], len(f.get("waiting", []))) for f in closed] == [
            (1, "quorum", 1),
            (2, "all", 0),
            (3, "quorum", 1),  # the slow one's next task waits on a gate never set
        ]
        # Held exactly its grace window after the quorum, on the fleet's clock.
        assert [f.get("after_quorum_s") for f in closed] == [GRACE_S, None, GRACE_S]
        assert run.clock.now() == 2 * GRACE_S  # only the two grace windows passed: no deadline, no silence
        merges = {f["round"]: f["results"] for f in run.of("merged")}
        assert [(m["name"], m["task_round"], m["staleness"]) for m in merges[3]] == [
            ("fast", 3, 0),
            ("slow", 1, 2),
        ]
        weight = 4 * 3**-0.5  # num_examples * (1 + s) ** -0.5, s = 2
        assert merges[3][1]["weight"] == pytest.approx(weight, rel=1e-12)
        # FedAvg of fresh (g2 + 1, weight 1) and late (g2 + its difference from g0: +10, weight w).
        expected = (g2.double() + (1.0 * 1 + weight * 10) / (1 + weight)).float()
        torch.testing.assert_close(g3, expected, rtol=0, atol=1e-6)
        assert run.engine.history[-1].extra["late_merged"] == 1.0
    finally:
        for g in run.slow.gates:
            g.set()
        run.close()


def test_result_staler_than_max_staleness_is_refused_and_changes_nothing(caplog):
    caplog.set_level(logging.WARNING, logger="fedgrid.client")
    gate = threading.Event()
    run = Run(Quorum(min_quorum=1, grace_s=0.0, max_staleness=1), [gate, threading.Event()])
    try:
        for r in (1, 2):
            run.round(r)
        gate.set()  # lands for merge round 3: 2 rounds stale, over max_staleness=1
        wait_until(lambda: run.of("late_refused"), timeout=30, what="the refusal")
        (refused,) = run.of("late_refused")
        assert refused["round"] == 1 and refused["reason"] == (
            "result of round 1 is 2 rounds stale; max_staleness is 1"
        )
        # The client heard it as FAILED_PRECONDITION with that message (a closed round's
        # status), and goes on to its next task.
        wait_until(
            lambda: any("2 rounds stale; max_staleness is 1" in r.getMessage() for r in caplog.records),
            timeout=30,
            what="the client to hear the refusal",
        )
        before = run.engine.strategy.global_state["w"].clone()
        g3 = run.round(3)
        merges = {f["round"]: f["results"] for f in run.of("merged")}
        assert [m["name"] for m in merges[3]] == ["fast"]
        torch.testing.assert_close(g3, before + 1, rtol=0, atol=0)  # the refused result changed nothing
    finally:
        for g in run.slow.gates:
            g.set()
        run.close()


def test_a_task_carried_past_its_quorum_expires_at_its_deadline(caplog):
    """The slow client keeps its task after the quorum closed the round; at the task's deadline
    (30 s of the fleet's clock, not a moment before) it is benched and its result no longer taken."""
    clock = ManualClock()
    state = OrderedDict(w=torch.zeros(3))
    server = InProcessCoordinator(state, clock=clock)
    fast, slow = Connection(server.address), Connection(server.address)
    try:
        fast.join(Named("fast"))
        slow.join(Named("slow"))
        infos = server.fleet.wait_for_clients(min_clients=2, timeout=timedelta(0))
        round_1 = Call(
            lambda: server.fleet.fit_round(
                server_round=1,
                global_state=state,
                assignments=[(info, FitIns(round=1)) for info in infos],
                timeout=timedelta(seconds=30),
                quorum=Quorum(min_quorum=1),
            )
        )
        task = fast.poll(5).task
        update = OrderedDict((k, v + 1) for k, v in fast.download(task.task_id).items())
        fast.upload(task.task_id, task.round, update, 1, {})
        outcome = round_1.result()
        assert outcome.closed_by == "quorum" and [c.name for c in outcome.waiting] == ["slow"]
        server.fleet.committed(1)
        record = server.fleet.membership.records[slow.client_id]
        free = lambda: [c.name for c in server.fleet.wait_for_clients(min_clients=1, timeout=timedelta(0))]  # noqa: E731
        clock.advance(29.5)
        assert free() == ["fast"] and record.benched_task == ""  # still on its task: busy, not benched
        with caplog.at_level(logging.WARNING, logger="fedgrid.server.late_results"):
            clock.advance(0.5)
            assert free() == ["fast"] and record.benched_task == task.task_id
        assert [r.getMessage() for r in caplog.records if r.name == "fedgrid.server.late_results"] == [
            "round 1: client 'slow' missed its task's deadline (carried past the quorum)"
        ]
        assert server.fleet.carried.busy() == set()
        with pytest.raises(RpcFailed) as refused:
            slow.upload(task.task_id, task.round, update, 1, {})
        assert (refused.value.code, refused.value.details) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "round 1 is closed",
        )
    finally:
        for conn in (fast, slow):
            conn.close()
        server.stop()


def test_late_results_from_other_identities_never_set_the_reference_of_the_round_they_merge_into():
    """The issue's run (``--min-quorum 2 --grace-s 1 --max-staleness 2``, default bounds): two
    fresh honest workers step 3.65 from each round's model; two others, slow, step 0.0696 from
    round 1's and land during round 2. Their distances once set round 2's lower median (0.0696),
    and both fresh updates were refused ("distance 3.65 ... median 0.0696"): the round committed
    only the late results. Now round 2 takes all four."""
    per_value = 3**-0.5  # w has three values: a step ``s`` on each is a distance of s * sqrt(3)
    gates = [threading.Event(), threading.Event()]
    clients = [
        Stepper("a", 3.65 * per_value, 1, []),
        Stepper("b", 3.66 * per_value, 1, []),
        # Slow in round 2 as well (a gate never set): round 2's fresh updates are a's and b's.
        Stepper("c", 0.0696 * per_value, 1, [gates[0], threading.Event()]),
        Stepper("d", 0.0697 * per_value, 1, [gates[1], threading.Event()]),
    ]
    run = Run(Quorum(min_quorum=2, grace_s=1.0, max_staleness=2), [], clients=clients, influence=Influence())
    try:
        run.round(1)  # all four asked; closes at its quorum with a and b, c and d keep their tasks
        for gate in gates:
            gate.set()
        wait_until(
            lambda: sum(bool(f.get("late")) for f in run.of("update_accepted")) == 2,
            timeout=30,
            what="late results",
        )
        run.round(2)
        assert run.of("update_refused") == []
        merges = {f["round"]: f["results"] for f in run.of("merged")}
        assert sorted((m["name"], m["task_round"]) for m in merges[2]) == [
            ("a", 2),
            ("b", 2),
            ("c", 1),
            ("d", 1),
        ]
        assert (run.engine.history[-1].clients_ok, run.engine.history[-1].extra["late_merged"]) == (2, 2.0)
    finally:
        for c in clients:
            for g in c.gates:
                g.set()
        run.close()
