"""The client SDK against a real coordinator: large models, retries, background threads."""

from __future__ import annotations

import time
from collections import OrderedDict
from datetime import timedelta

import grpc
import pytest
import torch

from fedgrid.client import Client, FitOutput, RpcFailed, run_client, start_client
from fedgrid.client.runtime import Connection
from fedgrid.proto import serde
from fedgrid.telemetry import without_timing

from harness import FailFirst, InProcessCoordinator, wait_until


class AddOne(Client):
    """Returns the global model plus one: easy to check on the server."""

    def __init__(self, name: str = "add-one") -> None:
        self.name = name
        self.seen_rounds: list[int] = []

    @property
    def num_examples(self) -> int:
        return 3

    def fit(self, state, ins):
        self.seen_rounds.append(ins.round)
        return FitOutput(
            OrderedDict((k, v + 1) for k, v in state.items()), num_examples=3, metrics={"loss": 0.5}
        )


def test_model_over_64_mb_crosses_the_wire_intact():
    g = torch.Generator().manual_seed(1)
    state = OrderedDict(
        [
            ("embed", torch.randn(17_000_000, generator=g)),
            ("head", torch.randn(1000, 10, generator=g).to(torch.bfloat16)),
        ]
    )
    assert sum(t.numel() * t.element_size() for t in state.values()) > 64 * 1024 * 1024
    server = InProcessCoordinator(state)
    try:
        conn = Connection(server.address)
        conn.join(AddOne())
        server.open_round()
        task = conn.poll(5).task
        got = conn.download(task.task_id)
        for name, tensor in state.items():
            assert serde.checksum(memoryview(got[name].view(torch.uint8).numpy())) == serde.checksum(
                memoryview(tensor.view(torch.uint8).numpy())
            )
            assert torch.equal(got[name], tensor)
        assert conn.upload(task.task_id, task.round, got, 1, {}) == sum(
            t.numel() * t.element_size() for t in state.values()
        )
        outcome = server.wait_round()
        assert torch.equal(outcome.results[0].state["embed"], state["embed"])
        assert outcome.bytes_down > 68_000_000 and outcome.bytes_up > 68_000_000
        conn.close()
    finally:
        server.stop()


def test_background_client_trains_and_leaves(small_state):
    server = InProcessCoordinator(small_state)
    client = AddOne()
    try:
        handle = start_client(client, server.address, poll_wait_s=1.0)
        wait_until(lambda: len(server.fleet.live_clients()) == 1, timeout=20, what="client to join")
        server.open_round()
        outcome = server.wait_round()
        assert [r.client.name for r in outcome.results] == ["add-one"]
        for name, tensor in small_state.items():
            assert torch.equal(outcome.results[0].state[name], tensor + 1)
        assert outcome.results[0].num_examples == 3 and without_timing(outcome.results[0].metrics) == {
            "loss": 0.5
        }
        server.fleet.finish(timeout=timedelta(seconds=20))
        summary = handle.join(timeout=20)
        assert summary.rounds == 1 and client.seen_rounds == [1]
        assert not handle.running
    finally:
        server.stop()


def test_transient_failures_are_retried(small_state):
    flaky = FailFirst("Join", grpc.StatusCode.UNAVAILABLE, times=2)
    server = InProcessCoordinator(small_state, interceptors=[flaky])
    try:
        conn = Connection(server.address, retry_max_wait=0.05)
        conn.join(AddOne())
        assert flaky.calls == 3
        assert len(server.fleet.live_clients()) == 1
        conn.close()
    finally:
        server.stop()


def test_retries_are_bounded(small_state):
    down = FailFirst("Join", grpc.StatusCode.UNAVAILABLE, times=10**9)
    server = InProcessCoordinator(small_state, interceptors=[down])
    try:
        start_t = time.monotonic()
        with pytest.raises(RpcFailed) as err:
            run_client(AddOne(), server.address, retry_max_elapsed=1.0, retry_max_wait=0.1)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert "injected UNAVAILABLE" in str(err.value)
        assert time.monotonic() - start_t < 10
        assert down.calls >= 3
    finally:
        server.stop()


def test_other_errors_surface_at_once_with_their_message(small_state):
    denied = FailFirst("Join", grpc.StatusCode.PERMISSION_DENIED, times=1)
    server = InProcessCoordinator(small_state, interceptors=[denied])
    try:
        with pytest.raises(RpcFailed) as err:
            run_client(AddOne(), server.address)
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "Join failed: PERMISSION_DENIED: injected PERMISSION_DENIED" == str(err.value)
        assert denied.calls == 1
    finally:
        server.stop()


def test_client_fit_error_rejected_update_surfaces(small_state):
    """An update the coordinator refuses is that round's failure, with the refusal's words in
    the client's ``error`` event; the client goes on to the next round (a diverged one, NaN,
    is caught by the SDK first and reported instead: test_failure_reports)."""

    class Broken(AddOne):
        def fit(self, state, ins):
            claim = 1000 if ins.round == 1 else 3  # it reported 3: round 1's claim is refused
            return FitOutput(OrderedDict((k, v + 1) for k, v in state.items()), num_examples=claim)

    server = InProcessCoordinator(small_state)
    events = []
    try:
        handle = start_client(Broken(), server.address, poll_wait_s=1.0, on_event=events.append)
        wait_until(lambda: len(server.fleet.live_clients()) == 1, timeout=20, what="client to join")
        server.open_round(timeout_s=5)
        outcome = server.wait_round()
        assert outcome.results == [] and len(outcome.failures) == 1
        # The failure report closes the round; the event follows once the report returned.
        wait_until(lambda: any(e.kind == "error" for e in events), timeout=20, what="the error event")
        errors = [e for e in events if e.kind == "error"]
        assert [e.round for e in errors] == [1]
        assert "update refused: " in errors[0].detail
        assert "claims 1000, the client reported 3 at join" in errors[0].detail
        server.open_round(server_round=2, timeout_s=5)  # the same client, still joined, trains round 2
        outcome = server.wait_round()
        assert [r.num_examples for r in outcome.results] == [3] and outcome.failures == []
        assert handle._thread.is_alive() and handle.error is None
        handle.stop()  # not left polling a stopped coordinator, logging into later tests' captures
        handle.join(timeout=30)
    finally:
        server.stop()
