"""Over-selection: a round asks more clients than it needs, closes at its target, and
refuses the late updates cleanly."""

from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import timedelta

from fedgrid.client import Client, FitOutput, start_client

from harness import InProcessCoordinator, wait_until


class Gated(Client):
    """Trains only once ``gate`` is set; records what the coordinator said of its update."""

    def __init__(self, name: str, gate: threading.Event) -> None:
        self.name, self.gate = name, gate
        self.fits = 0

    @property
    def num_examples(self) -> int:
        return 1

    def fit(self, state, ins):
        self.gate.wait(60)
        self.fits += 1
        return FitOutput(OrderedDict((k, v + 1) for k, v in state.items()), num_examples=1)


def test_round_closes_at_target_and_refuses_the_rest(small_state):
    server = InProcessCoordinator(small_state)
    fast, slow = threading.Event(), threading.Event()
    fast.set()
    clients = [Gated(f"fast-{i}", fast) for i in range(3)] + [Gated(f"slow-{i}", slow) for i in range(2)]
    try:
        handles = [start_client(c, server.address, poll_wait_s=1.0) for c in clients]
        wait_until(lambda: len(server.fleet.live_clients()) == 5, timeout=30, what="clients to join")
        server.open_round(min_clients=5, target=3)
        outcome = server.wait_round(timeout=30)
        assert sorted(r.client.name for r in outcome.results) == ["fast-0", "fast-1", "fast-2"]
        assert sorted(c.name for c in outcome.cancelled) == ["slow-0", "slow-1"]
        assert outcome.failures == []
        slow.set()  # the cancelled clients now finish: their uploads are refused, they carry on
        wait_until(lambda: all(c.fits == 1 for c in clients), timeout=30, what="slow clients to finish")
        server.fleet.finish(timeout=timedelta(seconds=20))
        for handle in handles:
            assert handle.join(timeout=30).client_id
        assert [h.summary.rounds for h in handles] == [1, 1, 1, 0, 0]  # refused updates do not count
    finally:
        server.stop()
