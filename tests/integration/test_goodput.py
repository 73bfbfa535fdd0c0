"""Goodput you can see, over in-process gRPC: each fit result's time split, the round sums in
``metrics.jsonl``, the ``/metrics`` histograms and the status page's utilization per client."""

from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import timedelta

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from fedgrid.aggregation import FedAvg
from fedgrid.client import Client, FitOutput, connect, start_client
from fedgrid.runlog import RunWriter, read_metrics
from fedgrid.server.engine import RoundEngine
from fedgrid.server.monitor import CoordinatorMonitor
from fedgrid.server.parts import RunIO, Schedule
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.server.status_page import page_response
from fedgrid.telemetry import SPLIT_KEYS, goodput_metrics

from harness import wait_until

ROUNDS = 3


def _work() -> torch.Tensor:
    """A few milliseconds of real compute."""
    x = torch.ones(128, 128)
    for _ in range(20):
        x = torch.tanh(x @ x / 128)
    return x


class Worker(Client):
    def __init__(self, name: str, region: str) -> None:
        self.name, self.region = name, region

    @property
    def num_examples(self) -> int:
        return 3

    def fit(self, state, ins):
        _work()
        return FitOutput(OrderedDict((k, v.clone()) for k, v in state.items()), 3, {"loss": 0.5})


class Recording(FedAvg):
    """FedAvg that keeps every fit result it aggregates."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, list] = {}

    def aggregate(self, *, server_round, results, failures):
        self.seen[server_round] = list(results)
        return super().aggregate(server_round=server_round, results=results, failures=failures)


def _host(address: str, computed: list[float]) -> None:
    """An embedding session whose host program trains inside ``session.compute()``."""
    with connect(address, name="host", region="us", num_examples=3, poll_wait_s=1.0) as session:
        for task in session.tasks():
            clock = session.timeline.clock
            start = clock()
            with session.compute():
                _work()
            computed.append(clock() - start)
            session.submit(FitOutput(OrderedDict(task.state), 3, {"loss": 0.5}))


def test_splits_reach_metrics_jsonl_prometheus_and_the_status_page(tmp_path, small_state):
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=30))
    server = Coordinator("127.0.0.1:0", fleet, max_workers=16).start()
    strategy = Recording()
    strategy.initialize(initial_state=small_state)
    writer = RunWriter(tmp_path / "run", {"rounds": ROUNDS})
    engine = RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=ROUNDS,
            min_clients=3,
            round_timeout=timedelta(seconds=60),
            join_timeout=timedelta(seconds=60),
            finish_timeout=timedelta(seconds=10),
        ),
        io=RunIO(
            writer=writer,
            events=fleet.events,
        ),
    )
    monitor = CoordinatorMonitor(fleet, rounds=ROUNDS, history=lambda: engine.history)
    fleet.events.subscribe(monitor.on_event)
    computed: list[float] = []
    host = threading.Thread(target=_host, args=(server.address, computed), daemon=True)
    host.start()
    handles = [
        start_client(Worker(n, r), server.address, poll_wait_s=1.0) for n, r in (("a", "eu"), ("b", "eu"))
    ]
    try:
        wait_until(lambda: len(fleet.live_clients()) == 3, timeout=30, what="clients to join")
        runner = threading.Thread(target=engine.run, daemon=True)
        runner.start()
        runner.join(timeout=120)
        assert not runner.is_alive()
        assert [h.join(timeout=30).rounds for h in handles] == [ROUNDS, ROUNDS]
        host.join(timeout=30)
        assert not host.is_alive() and len(computed) == ROUNDS

        # Every fit result: the six keys, a split that adds up to its window.
        for server_round in range(1, ROUNDS + 1):
            results = strategy.seen[server_round]
            assert sorted(r.client.name for r in results) == ["a", "b", "host"]
            for r in results:
                m = r.metrics
                assert set(SPLIT_KEYS) <= set(m)
                assert m["compute_s"] + m["comm_s"] + m["wait_s"] == pytest.approx(m["wall_s"], abs=1e-9)
                assert 0 <= m["utilization"] <= 1 and m["compute_s"] > 0 and m["transfer_s"] > 0
                assert m["utilization"] == pytest.approx(m["compute_s"] / m["wall_s"])
            # The host's compute is what it said: its session.compute() block (timed from outside it), no more.
            (host_result,) = [r for r in results if r.client.name == "host"]
            assert 0 < host_result.metrics["compute_s"] <= computed[server_round - 1]

        # metrics.jsonl: the round sums and the ratio of sums, per region too.
        rows = read_metrics(writer.dir)
        assert [row["round"] for row in rows] == list(range(1, ROUNDS + 1))
        for row in rows:
            assert goodput_metrics(strategy.seen[row["round"]]) == {
                k: row[k]
                for k in (
                    "compute_s",
                    "comm_s",
                    "wait_s",
                    "transfer_s",
                    "worker_wall_s",
                    "utilization",
                    "utilization.eu",
                    "utilization.us",
                )
            }
            assert row["compute_s"] + row["comm_s"] + row["wait_s"] == pytest.approx(row["worker_wall_s"])
            assert 0 < row["utilization"] < 1

        # /metrics: one observation per fit result, by region, never by client.
        samples = {}
        for family in text_string_to_metric_families(monitor.metrics_text().decode()):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        for region, clients in (("eu", 2), ("us", 1)):
            for part in ("compute", "comm", "wait"):
                key = ("fedgrid_task_seconds_count", (("part", part), ("region", region)))
                assert samples[key] == clients * ROUNDS
            assert samples[("fedgrid_task_utilization_count", (("region", region),))] == clients * ROUNDS
        assert "host" not in monitor.metrics_text().decode()

        # The status page: a utilization cell per client, from each one's last split.
        status = monitor.status()
        last = {r.client.client_id: r.metrics for r in strategy.seen[ROUNDS]}
        assert {c["name"]: c["utilization"] for c in status["clients"]} == {
            r.client.name: r.metrics["utilization"] for r in strategy.seen[ROUNDS]
        }
        for c in status["clients"]:
            assert c["compute_s"] == last[c["id"]]["compute_s"]
        eu = [
            m for cid, m in last.items() if cid in {c["id"] for c in status["clients"] if c["region"] == "eu"}
        ]
        assert [(r["region"], r["clients"]) for r in status["regions"]] == [("eu", 2), ("us", 1)]
        assert status["regions"][0]["utilization"] == pytest.approx(
            sum(m["compute_s"] for m in eu) / sum(m["wall_s"] for m in eu)
        )
        html = page_response().body.decode()
        assert "<th>utilization</th>" in html
        assert 'cell(tr, num(c.utilization, 2), split(c)).className = "utilization"' in html
    finally:
        for h in handles:
            h.stop()
        server.stop(grace=0.5)
        fleet.close()
