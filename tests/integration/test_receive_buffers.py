"""Receive buffers are reused across transfers, and the coordinator gives the free ones back
when a round closes, before aggregating (the pool must not add to aggregation's memory)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from fedgrid.client.api import Client
from fedgrid.client.runtime import Connection
from fedgrid.proto import buffers
from fedgrid.proto.buffers import BufferPool, receive_buffers

from harness import InProcessCoordinator


class _Named(Client):
    name = "pool-probe"

    @property
    def num_examples(self) -> int:  # reported at join: its updates may claim no more
        return 1

    def fit(self, state, ins):  # type: ignore[no-untyped-def]
        raise AssertionError("not trained")


def test_round_close_releases_free_receive_buffers_and_keeps_the_accepted_update(monkeypatch):
    # A pool of this test's own: a coordinator another test of this worker left running holds
    # the process's pool from its start, and its round closes would clear this test's buffer.
    monkeypatch.setattr(buffers, "_shared", BufferPool())
    state = OrderedDict(w=torch.arange(1 << 20, dtype=torch.float32), b=torch.ones(3))  # 4 MiB: pooled
    coordinator = InProcessCoordinator(state)
    conn = Connection(coordinator.address)
    try:
        conn.join(_Named())
        pool = receive_buffers()
        reused = pool.stats().reused
        for server_round in (1, 2):
            coordinator.open_round(server_round=server_round)
            task = conn.poll(10.0).task
            model = conn.download(task.task_id)  # the client's receive buffer, from this process's pool
            update = OrderedDict((k, v + server_round) for k, v in model.items())
            del model  # its buffer goes back to the pool, free
            assert pool.stats().free_bytes >= 4 << 20
            conn.upload(task.task_id, task.round, update, 1, {})
            outcome = coordinator.wait_round()
            stats = pool.stats()
            assert stats.free_bytes == 0, stats  # released when the round closed
            assert stats.reused == reused + server_round  # the upload was received into the download's buffer
            assert torch.equal(outcome.results[0].state["w"], state["w"] + server_round)
            del outcome
    finally:
        conn.close()
        coordinator.stop()
