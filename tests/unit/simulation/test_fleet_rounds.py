"""``InProcessFleet``'s rounds that train nothing (``fedgrid.simulation.fleet_rounds``): each
client evaluates the global model it received over the simulated wire, and a failure or an
empty evaluation is a ``Failure``; a message phase relays what the available clients sent and
fails the unavailable ones. A fit is timed on the fleet's clock."""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta
from typing import Mapping

import torch

from fedgrid.client.api import Client, EvaluateOutput, FitOutput
from fedgrid.clock import ManualClock
from fedgrid.proto import serde
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.types import TO_SERVER, EvaluateIns, Failure, FitIns, MessageIns, ModelState, Scalar

ROUND = 2


class _Member(Client):
    """Evaluates to ``evaluated`` examples (``None``: raises); sends ``payload`` to the next client."""

    def __init__(self, index: int, evaluated: int | None) -> None:
        self.name, self.index, self.evaluated = f"member-{index}", index, evaluated
        self.inbox: dict[str, bytes] | None = None

    @property
    def num_examples(self) -> int:
        return 10

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        raise NotImplementedError

    def evaluate(self, state: ModelState, config: Mapping[str, Scalar]) -> EvaluateOutput:
        if self.evaluated is None:
            raise RuntimeError("no test data")
        return EvaluateOutput(
            self.evaluated, {"sum": float(state["w"].sum()), "scale": float(config["scale"])}
        )

    def exchange(self, ins: MessageIns) -> Mapping[str, bytes]:
        after = ins.peers[(ins.peers.index(ins.client_id) + 1) % len(ins.peers)]
        return {after: bytes([self.index]) * (self.index + 1), TO_SERVER: b"s"}

    def receive(self, ins: MessageIns, inbox: Mapping[str, bytes]) -> None:
        self.inbox = dict(inbox)


class _SecondUnavailable:
    """Client 1 is unavailable in every round."""

    def available(self, index: int, server_round: int) -> bool:
        return index != 1

    def region(self, index: int) -> str:
        return ""

    def train_seconds(self, index: int, num_examples: int) -> float:
        return 1.0


def test_each_client_evaluates_what_it_downloaded_and_an_empty_or_failed_one_fails():
    members = [_Member(0, 7), _Member(1, 0), _Member(2, None), _Member(3, 5)]
    fleet = InProcessFleet(members)
    infos = fleet.wait_for_clients(min_clients=4, timeout=timedelta(0))
    state = OrderedDict(w=torch.arange(6, dtype=torch.float32).reshape(2, 3))
    outcome = fleet.evaluate_round(
        server_round=ROUND,
        global_state=state,
        assignments=[(info, EvaluateIns(ROUND, {"scale": 0.5})) for info in infos],
        timeout=timedelta(seconds=5),
    )
    assert [(r.client.name, r.num_examples, dict(r.metrics)) for r in outcome.results] == [
        ("member-0", 7, {"sum": 15.0, "scale": 0.5}),
        ("member-3", 5, {"sum": 15.0, "scale": 0.5}),
    ]
    assert outcome.failures == [
        Failure(infos[1], "evaluated no examples"),
        Failure(infos[2], "RuntimeError: no test data"),
    ]
    down = serde.EncodedModel(state).frames(serde.StreamInfo(round=ROUND), chunk_size=serde.CHUNK_SIZE)
    assert outcome.bytes_down == 4 * sum(serde.wire_size(c) for c in down)

    def up(n: int) -> int:  # the header a client that evaluated uploads
        head = serde.StreamInfo(round=ROUND, num_examples=n, metrics={"sum": 15.0, "scale": 0.5})
        return sum(serde.wire_size(c) for c in serde.EncodedModel({}).frames(head))

    assert outcome.bytes_up == up(7) + up(0) + up(5)  # the empty one uploaded its header too


def test_a_message_phase_relays_what_the_available_clients_sent():
    members = [_Member(i, 1) for i in range(4)]
    fleet = InProcessFleet(members, profiles=_SecondUnavailable())
    infos = fleet.wait_for_clients(min_clients=4, timeout=timedelta(0))
    peers = tuple(info.client_id for info in infos)
    outcome = fleet.message_round(
        server_round=ROUND,
        phase="ring",
        assignments=[(info, MessageIns(ROUND, "ring", peers=peers)) for info in infos],
        timeout=timedelta(seconds=5),
    )
    assert outcome.failures == [Failure(infos[1], f"unavailable in round {ROUND} (simulated)")]
    assert [r.client.name for r in outcome.results] == ["member-0", "member-2", "member-3"]
    assert dict(outcome.results[0].messages) == {TO_SERVER: b"s", peers[1]: b"\x00"}
    # Client 1 sent nothing, so it received nothing; the others got their predecessor's message.
    assert [m.inbox for m in members] == [
        {peers[3]: b"\x03" * 4},
        None,
        {},
        {peers[2]: b"\x02" * 3},
    ]
    # Up: each sender's two messages; down: what was relayed (client 0's byte to client 1 was not).
    assert (outcome.bytes_up, outcome.bytes_down) == ((1 + 1) + (3 + 1) + (4 + 1), 4 + 3)


class _Timed(Client):
    """Returns the model plus one, its fit taking ``seconds`` of the fleet's clock."""

    def __init__(self, name: str, clock: ManualClock, seconds: float) -> None:
        self.name, self.clock, self.seconds = name, clock, seconds

    @property
    def num_examples(self) -> int:
        return 10

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        self.clock.advance(self.seconds)
        return FitOutput(OrderedDict((k, v + 1) for k, v in state.items()), num_examples=10)


def test_a_fit_is_timed_on_the_fleets_clock():
    clock = ManualClock()
    fleet = InProcessFleet([_Timed("quick", clock, 0.25), _Timed("slow", clock, 1.5)], clock=clock)
    infos = fleet.wait_for_clients(min_clients=2, timeout=timedelta(0))
    outcome = fleet.fit_round(
        server_round=1,
        global_state=OrderedDict(w=torch.zeros(3)),
        assignments=[(info, FitIns(round=1)) for info in infos],
        timeout=timedelta(seconds=5),
    )
    split = {
        r.client.name: (r.metrics["compute_s"], r.metrics["wall_s"], r.metrics["wait_s"])
        for r in outcome.results
    }
    assert split == {"quick": (0.25, 0.25, 0.0), "slow": (1.5, 1.5, 0.0)} and clock.now() == 1.75
