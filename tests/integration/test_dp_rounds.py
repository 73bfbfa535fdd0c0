"""Differential privacy in the round engine: clipped and noised updates, epsilon every round, a
run that stops before its budget, and a budget that survives a crash and resume (issue 28)."""

from __future__ import annotations

import json
from collections import OrderedDict
from datetime import timedelta

import pytest
import torch

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.privacy import noise_share
from fedgrid.aggregation.selection import Sampling
from fedgrid.errors import ConfigError, PrivacyBudgetError
from fedgrid.events import EventLog
from fedgrid.fleet.base import Fleet, RoundOutcome
from fedgrid.runlog import RunWriter
from fedgrid.server.engine import RoundEngine
from fedgrid.server.influence import Influence
from fedgrid.server.parts import RoundRules, RunIO, Schedule
from fedgrid.server.privacy import Privacy
from fedgrid.server.state import StateStore
from fedgrid.types import ClientInfo, FitRes

CLIENTS = [ClientInfo(client_id=f"c{i}", name=f"site-{i}", num_examples=10 * (i + 1)) for i in range(10)]
KEY = bytes(range(32))


class Linear(Fleet):
    """Client i sends ``global + (i + 1) * 0.5`` on every tensor (norms 0.5 .. 5 times sqrt(size)),
    claiming ``10 * (i + 1)`` examples; ``crash_at``: the round whose fit phase dies (a killed coordinator)."""

    def __init__(self, crash_at: int = 0) -> None:
        self.crash_at = crash_at

    def wait_for_clients(self, *, min_clients, timeout):
        return CLIENTS

    def fit_round(self, *, server_round, global_state, assignments, timeout, target=None):
        if server_round == self.crash_at:
            raise SystemExit("killed")
        index = {c.client_id: i for i, c in enumerate(CLIENTS)}
        results = [
            FitRes(
                info,
                OrderedDict(
                    (k, v + 0.5 * (index[info.client_id] + 1) if v.is_floating_point() else v)
                    for k, v in global_state.items()
                ),
                info.num_examples,
            )
            for info, _ in assignments
        ]
        return RoundOutcome(results, [])

    def evaluate_round(self, *, server_round, global_state, assignments, timeout):
        return RoundOutcome([], [])

    def message_round(self, *, server_round, phase, assignments, timeout):
        return RoundOutcome([], [])


def _engine(fleet: Fleet, privacy: Privacy | None, *, rounds: int = 20, store=None, writer=None):
    strategy = FedAvg(sampling=Sampling(fraction_fit=0.5, min_fit_clients=2, seed=7))
    strategy.initialize(initial_state=OrderedDict(w=torch.zeros(4), b=torch.zeros(1), n=torch.tensor(0)))
    events = EventLog()
    seen: list = []
    events.subscribe(seen.append)
    engine = RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=rounds,
            min_clients=1,
            round_timeout=timedelta(seconds=1),
            join_timeout=timedelta(seconds=1),
        ),
        rules=RoundRules(
            influence=Influence(max_update_ratio=0, max_weight_ratio=0),
            privacy=privacy,
        ),
        io=RunIO(
            writer=writer,
            store=store,
            events=events,
        ),
    )
    return engine, seen


def _privacy(key: bytes | None = KEY, **kw) -> Privacy:
    return Privacy(noise_multiplier=kw.pop("sigma", 1.0), clip=kw.pop("clip", 1.0), key=key, **kw)


def test_the_mean_is_the_clipped_updates_plus_the_keyed_noise_over_n():
    engine, _ = _engine(Linear(), _privacy(), rounds=1)
    final = engine.run()
    # Five of ten clients, each update (norm >= 0.5 * sqrt(5) > 1) clipped to norm 1: every
    # clipped update is the same, (1/sqrt(5)) per float entry, whatever the claims (weight 1 each).
    noise = noise_share(KEY, 1, OrderedDict(w=torch.zeros(4), b=torch.zeros(1)), std=1.0)
    for name in ("w", "b"):
        expected = 1 / 5**0.5 + noise[name] / 5
        assert torch.allclose(final[name], expected, atol=1e-6), name
    assert final["n"].item() == 0  # an integer buffer is the strategy's, as without DP
    m = engine.history[0]
    assert m.extra["dp_clip"] == 1.0 and m.extra["epsilon"] > 0


def test_epsilon_is_recorded_every_round_and_the_run_stops_before_its_budget(tmp_path):
    writer = RunWriter(tmp_path / "run", {})
    engine, seen = _engine(Linear(), _privacy(sigma=1.0, epsilon=8.0), writer=writer)
    final = engine.run()
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epsilons = [row["epsilon"] for row in rows]
    assert len(rows) < 20 and epsilons == sorted(epsilons) and epsilons[-1] <= 8.0
    # The next round (half the clients sampled) would have gone over: it never ran.
    assert engine.privacy.accountant.epsilon_after(0.5, 1.0) > 8.0
    stop = [e for e in seen if e.event == "privacy_budget_reached"]
    assert len(stop) == 1 and stop[0].fields["round"] == len(rows) + 1
    assert f"round {len(rows) + 1} would spend epsilon" in stop[0].fields["reason"]
    assert "dp_epsilon 8 at delta 1e-05" in stop[0].fields["reason"]
    assert final is not None and (tmp_path / "run" / "model.safetensors").exists()


def test_a_killed_and_resumed_coordinator_keeps_its_budget_and_its_noise(tmp_path):
    clean, _ = _engine(Linear(), _privacy(epsilon=8.0), store=StateStore(tmp_path / "clean"))
    expected = clean.run()
    crashed, _ = _engine(Linear(crash_at=4), _privacy(epsilon=8.0), store=StateStore(tmp_path / "s"))
    with pytest.raises(SystemExit):
        crashed.run()
    assert [m.round for m in crashed.history] == [1, 2, 3]
    # A new process: a fresh random key, an empty accountant; the checkpoint restores both.
    resumed, _ = _engine(Linear(), _privacy(key=None, epsilon=8.0), store=StateStore(tmp_path / "s"))
    final = resumed.run()
    assert resumed.privacy.key == KEY and resumed.privacy.accountant.rounds == len(clean.history)
    assert [m.round for m in resumed.history] == [m.round for m in clean.history]  # stops at the same round
    assert [m.extra["epsilon"] for m in resumed.history] == [m.extra["epsilon"] for m in clean.history]
    for name in expected:
        assert torch.equal(final[name], expected[name]), name  # the redone round drew the same noise


def test_a_run_cannot_switch_dp_on_or_off_across_a_restart(tmp_path):
    engine, _ = _engine(Linear(), _privacy(), rounds=1, store=StateStore(tmp_path))
    engine.run()
    off, _ = _engine(Linear(), None, rounds=2, store=StateStore(tmp_path))
    with pytest.raises(ConfigError, match="written with DP on"):
        off.run()
    engine, _ = _engine(Linear(), None, rounds=1, store=StateStore(tmp_path / "plain"))
    engine.run()
    on, _ = _engine(Linear(), _privacy(), rounds=2, store=StateStore(tmp_path / "plain"))
    with pytest.raises(ConfigError, match="written with DP off"):
        on.run()


def test_the_adaptive_clip_shrinks_towards_the_median_norm():
    engine, _ = _engine(Linear(), _privacy(clip=50.0, adaptive=True, sigma=0.5), rounds=6)
    engine.run()
    clips = [m.extra["dp_clip"] for m in engine.history]
    # Every update (norm at most 5 * sqrt(5)) is under 50: the clip falls each round.
    assert clips[0] == 50.0 and all(b < a for a, b in zip(clips, clips[1:]))
    assert all("dp_unclipped" in m.extra for m in engine.history)


def test_a_budget_smaller_than_one_round_runs_no_round():
    engine, _ = _engine(Linear(), _privacy(sigma=0.5, epsilon=0.01), rounds=3)
    engine.run()
    assert engine.history == []
    with pytest.raises(PrivacyBudgetError, match="round 1 would spend epsilon"):
        engine.privacy.check_budget(1, selected=5, live=10)
