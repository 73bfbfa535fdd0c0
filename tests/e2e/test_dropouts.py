"""30% of clients killed mid-round and one straggler: round 1 closes by its deadline and
aggregates exactly the updates that arrived; the straggler, alive but without a result, is
benched, so round 2 asks only the others and closes as soon as they report."""

from __future__ import annotations

import signal
import threading
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path

import torch

from fedgrid.aggregation import FedAvg
from fedgrid.aggregation.selection import Sampling
from fedgrid.events import EventLog
from fedgrid.server.engine import RoundEngine
from fedgrid.server.influence import Influence
from fedgrid.server.parts import RoundRules, Schedule
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.simulation.tasks import initial_state

from harness import start_client, wait_until

CLIENTS, VICTIMS, SLOW, DEADLINE_S, ROUNDS = 10, (1, 4, 8), 6, 6.0, 2


class Recording(FedAvg):
    """FedAvg that remembers who each round aggregated."""

    def __init__(self) -> None:
        super().__init__(sampling=Sampling(seed=0))
        self.rounds: list[tuple[list[str], OrderedDict]] = []

    def aggregate(self, *, server_round, results, failures):
        before = OrderedDict((k, v.clone()) for k, v in self.global_state.items())
        out = super().aggregate(server_round=server_round, results=results, failures=failures)
        self.rounds.append((sorted(r.client.name for r in results), before))
        return out


def test_dropouts_and_straggler(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "support" / "apps"))
    import slow_app

    markers = tmp_path / "markers"
    markers.mkdir()
    env = {
        "SLOW_APP_MARKER_DIR": str(markers),
        "SLOW_APP_FIT_S": "1.5",
        "SLOW_APP_SLOW_S": "30",
        "SLOW_APP_SLOW_CLIENT": str(SLOW),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    events = EventLog()
    seen: list = []
    events.subscribe(seen.append)
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=0.5), events=events)
    server = Coordinator("127.0.0.1:0", fleet, max_workers=64).start()
    strategy = Recording()
    strategy.initialize(initial_state=initial_state(slow_app.model, seed=0))
    engine = RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=ROUNDS,
            # The fleet's size once the victims are gone, straggler included: it is benched after
            # round 1, and round 2 runs without it (a benched client counts, it is not asked).
            min_clients=CLIENTS - len(VICTIMS),
            round_timeout=timedelta(seconds=DEADLINE_S),
            join_timeout=timedelta(seconds=60),
            finish_timeout=timedelta(seconds=5),
        ),
        # slow_app's updates are constant offsets of sizes 1 to 10: the largest lies past the median
        # update's spread bound (max_deviation_ratio, 3x), whose refusal is not this test's subject.
        rules=RoundRules(influence=Influence(max_deviation_ratio=0)),
    )
    clients = [
        start_client(
            server.address,
            tmp_path / f"c{i}.log",
            "--app",
            "slow_app:client",
            "--partition",
            f"{i}/{CLIENTS}",
        )
        for i in range(CLIENTS)
    ]
    try:
        wait_until(lambda: len(fleet.live_clients()) == CLIENTS, timeout=60, what="all clients to join")
        runner = threading.Thread(target=engine.run, daemon=True)
        runner.start()
        # Kill 30% of the clients while they compute round 1.
        wait_until(
            lambda: all((markers / f"fit-{i}-1").exists() for i in VICTIMS),
            timeout=60,
            what="victims mid-round",
        )
        for i in VICTIMS:
            clients[i].send_signal(signal.SIGKILL)
        runner.join(timeout=120)
        assert not runner.is_alive()
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
        server.stop(grace=0.5)
        fleet.close()

    survivors = [i for i in range(CLIENTS) if i not in VICTIMS and i != SLOW]
    assert len(engine.history) == ROUNDS
    for m in engine.history:
        assert m.clients_ok == len(survivors)
    # Round 1 closed because its deadline passed with the straggler still pending, not
    # because a result arrived; no update was accepted after the close. Round 2 did not ask
    # the benched straggler, so it closed when every client it asked had reported.
    closes = [e for e in seen if e.event == "round_closed"]
    assert [(e["round"], e["reason"], e["results"]) for e in closes] == [
        (1, "deadline", len(survivors)),
        (2, "all", len(survivors)),
    ]
    opened = [e for e in seen if e.event == "round_opened"]
    assert [e["clients"] for e in opened] == [CLIENTS, len(survivors)]
    for r, close in zip(range(1, ROUNDS + 1), closes):
        accepted = [e for e in seen if e.event == "update_accepted" and e["round"] == r]
        assert len(accepted) == len(survivors) and all(e.t <= close.t for e in accepted)
    assert (
        closes[0].t - opened[0].t >= DEADLINE_S - 0.05
    )  # never before its deadline (wall clock vs monotonic)
    assert engine.history[0].clients_failed == len(VICTIMS) + 1
    assert (
        engine.history[1].clients_failed == 0
    )  # the killed clients left the membership; the straggler is benched
    for (names, before), after in zip(
        strategy.rounds, [r[1] for r in strategy.rounds[1:]] + [strategy.global_state]
    ):
        assert names == sorted(f"slow-{i:03d}/{CLIENTS}" for i in survivors)
        # The exact example-weighted mean of the arrived updates: global + sum w_i (i+1) / sum w_i, w_i = i + 1.
        shift = sum((i + 1) * (i + 1) for i in survivors) / sum(i + 1 for i in survivors)
        for name, tensor in before.items():
            torch.testing.assert_close(after[name], tensor + shift, rtol=0, atol=1e-6)
