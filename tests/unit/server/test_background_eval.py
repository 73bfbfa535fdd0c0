"""The server-side evaluation never holds a round (issue 40, item 2): a coordinator evaluates
each round's model on a snapshot beside the next round, and its figures land in the row of
the round they measure, in the history and ``metrics.jsonl``."""

from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import timedelta

import pytest
import torch

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.selection import Sampling
from fedgrid.config import load_config
from fedgrid.errors import ConfigError
from fedgrid.events import EventLog
from fedgrid.fleet.base import Fleet, RoundOutcome
from fedgrid.runlog import RunWriter, read_metrics
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import RunIO, Schedule
from fedgrid.types import ClientInfo, FitRes

CLIENTS = [ClientInfo(client_id=f"c{i}", name=f"site-{i}", num_examples=i + 1) for i in range(2)]
WAIT_S = 30.0  # a deadline, not a pause: every wait below ends on its condition


class Adding(Fleet):
    """Client i sends ``global + (i + 1)``; ``fits`` is set once each round's fit phase is asked for."""

    def __init__(self) -> None:
        self.fits: dict[int, threading.Event] = {r: threading.Event() for r in range(1, 4)}

    def wait_for_clients(self, *, min_clients, timeout):
        return CLIENTS

    def fit_round(self, *, server_round, global_state, assignments, timeout, target=None):
        self.fits[server_round].set()
        results = [
            FitRes(info, OrderedDict((k, v + (i + 1)) for k, v in global_state.items()), i + 1)
            for i, (info, _) in enumerate(assignments)
        ]
        return RoundOutcome(results, [])

    def evaluate_round(self, *, server_round, global_state, assignments, timeout):
        return RoundOutcome([], [])

    def message_round(self, *, server_round, phase, assignments, timeout):
        return RoundOutcome([], [])


def _engine(fleet: Fleet, evaluate, *, background: bool, tmp_path, rounds: int = 3):
    strategy = FedAvg(sampling=Sampling(fraction_fit=1.0, min_fit_clients=2, seed=1))
    strategy.initialize(initial_state=OrderedDict(w=torch.zeros(3)))
    events = EventLog()
    seen: list = []
    events.subscribe(seen.append)
    writer = RunWriter(tmp_path / ("bg" if background else "inline"), {"rounds": rounds})
    engine = RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=rounds,
            min_clients=1,
            round_timeout=timedelta(seconds=1),
            join_timeout=timedelta(seconds=1),
        ),
        io=RunIO(evaluate_fn=evaluate, writer=writer, events=events, eval_in_background=background),
    )
    return engine, writer, seen


def _mean_of(state):
    return float(state["w"].mean()), {"accuracy": float(state["w"][0]) / 10.0, "w0": float(state["w"][0])}


def test_a_slow_evaluation_does_not_delay_the_next_round_and_lands_in_its_own_row(tmp_path):
    fleet = Adding()
    measured: list[float] = []

    def slow_evaluate(state):
        # Round 1's evaluation ends only once round 2's tasks went out: inline, it would hold
        # round 2 forever, and this wait would run out.
        w0 = float(state["w"][0])
        if not measured:
            assert fleet.fits[2].wait(WAIT_S), "round 2's tasks waited for round 1's evaluation"
        measured.append(w0)
        return _mean_of(state)

    engine, writer, seen = _engine(fleet, slow_evaluate, background=True, tmp_path=tmp_path)
    final = engine.run()
    assert final is not None
    # Each round's model is client-mean(global + 1, global + 2) weighted 1:2: global + 5/3.
    expected = [5 / 3, 10 / 3, 5.0]
    assert measured == pytest.approx(expected)  # round 1's snapshot, not round 2's model
    rows = read_metrics(writer.dir)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert [r["loss"] for r in rows] == pytest.approx(expected)
    assert [r["accuracy"] for r in rows] == pytest.approx([v / 10 for v in expected])
    assert [r["w0"] for r in rows] == pytest.approx(expected)
    assert [m.loss for m in engine.history] == pytest.approx(expected)
    names = [e.event for e in seen]
    # Round 1 committed before its evaluation landed; round 2's tasks went out in between.
    assert names.index("round_committed") < names.index("evaluated")
    assert [e["round"] for e in seen if e.event == "evaluated"] == [1, 2, 3]
    last_evaluated = len(names) - 1 - names[::-1].index("evaluated")
    assert names[-1] == "finished" and last_evaluated < names.index("finished")  # the last one waited for


def test_background_and_inline_evaluations_give_the_same_rows(tmp_path):
    inline, inline_writer, _ = _engine(Adding(), _mean_of, background=False, tmp_path=tmp_path)
    background, background_writer, _ = _engine(Adding(), _mean_of, background=True, tmp_path=tmp_path)
    inline.run(), background.run()
    keep = ("round", "loss", "accuracy", "w0")
    assert [{k: r[k] for k in keep} for r in read_metrics(inline_writer.dir)] == [
        {k: r[k] for k in keep} for r in read_metrics(background_writer.dir)
    ]


def test_a_failing_background_evaluation_leaves_the_row_without_figures_and_the_run_goes_on(tmp_path):
    def broken(state):
        raise RuntimeError("evaluation data unreadable")

    engine, writer, _ = _engine(Adding(), broken, background=True, tmp_path=tmp_path, rounds=2)
    assert engine.run() is not None
    assert [r["accuracy"] for r in read_metrics(writer.dir)] == [None, None]


@pytest.mark.parametrize("value", [0, -3])
def test_eval_batches_below_one_is_named(value):
    with pytest.raises(ConfigError, match="eval_batches.*at least 1"):
        load_config(overrides={"eval_batches": value})
