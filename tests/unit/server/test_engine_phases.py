"""The engine runs the phases a strategy declares, in order, and refuses bad declarations."""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta

import pytest
import torch

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.selection import Sampling
from fedgrid.fleet.base import Fleet, RoundOutcome
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import Schedule
from fedgrid.types import ClientInfo, MessageIns, MessageRes

CLIENTS = [ClientInfo(client_id=f"c{i}", name=f"n{i}") for i in range(2)]


class Recorder(Fleet):
    def __init__(self):
        self.calls = []

    def wait_for_clients(self, *, min_clients, timeout):
        return CLIENTS

    def fit_round(self, *, server_round, global_state, assignments, timeout, target=None):
        self.calls.append(("fit", server_round))
        return RoundOutcome([], [])

    def evaluate_round(self, *, server_round, global_state, assignments, timeout):
        self.calls.append(("evaluate", server_round))
        return RoundOutcome([], [])

    def message_round(self, *, server_round, phase, assignments, timeout):
        self.calls.append((phase, server_round))
        return RoundOutcome(
            [MessageRes(info, {"": b"x" * server_round}) for info, _ in assignments], [], bytes_up=3
        )


class Phased(FedAvg):
    def __init__(self, phases):
        super().__init__(sampling=Sampling(fraction_evaluate=1.0))
        self._phases = phases
        self.received = []

    def phases(self, *, server_round):
        return self._phases

    def configure_messages(self, *, server_round, phase, clients):
        return [(c, MessageIns(round=server_round, phase=phase)) for c in clients]

    def receive_messages(self, *, server_round, phase, results, failures):
        self.received.append((phase, [r.messages[""] for r in results]))
        return {f"{phase}_seen": float(len(results))}


def engine(strategy, fleet):
    strategy.initialize(initial_state=OrderedDict(w=torch.zeros(2)))
    return RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=2,
            min_clients=1,
            round_timeout=timedelta(seconds=1),
            join_timeout=timedelta(seconds=1),
        ),
    )


def test_phases_run_in_the_declared_order_each_round():
    fleet, strategy = Recorder(), Phased(("keys", "fit", "unmask", "evaluate"))
    eng = engine(strategy, fleet)
    eng.run()
    assert fleet.calls == [(p, r) for r in (1, 2) for p in ("keys", "fit", "unmask", "evaluate")]
    assert strategy.received[0] == ("keys", [b"x", b"x"]) and strategy.received[3] == (
        "unmask",
        [b"xx", b"xx"],
    )
    m = eng.history[0]
    assert (m.extra["keys_seen"], m.extra["keys_ok"], m.extra["keys_failed"], m.extra["unmask_bytes_up"]) == (
        2.0,
        2,
        0,
        3,
    )
    assert m.bytes_up == 6  # both message phases' bytes count in the round


@pytest.mark.parametrize(
    "phases, words", [(("fit", "fit"), "declared a phase twice"), (("Bad Name",), "phase name must be")]
)
def test_bad_phase_declarations_fail_before_any_client_is_asked(phases, words):
    fleet = Recorder()
    with pytest.raises(ValueError, match=words):
        engine(Phased(phases), fleet).run()
    assert fleet.calls == []


def test_a_message_phase_without_configure_messages_names_the_strategy():
    class NoMessages(FedAvg):
        def phases(self, *, server_round):
            return ("keys", "fit")

    with pytest.raises(NotImplementedError, match="NoMessages declares message phase 'keys'"):
        engine(NoMessages(), Recorder()).run()
