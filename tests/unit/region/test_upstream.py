"""Which upstream refusals a region sits out and which end it (``fedgrid.region.upstream``)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import grpc
import pytest

from fedgrid.client.rpc import IdentityConflict, RpcFailed
from fedgrid.client.runtime import RunSummary
from fedgrid.errors import RUN_FINISHED
from fedgrid.region import upstream
from fedgrid.region.upstream import RefusedUpstream, serve_upstream

CONFIG = SimpleNamespace(
    name="eu", upstream="global:50051", min_clients=1, join_timeout_s=1.0,
    upstream_ca=None, upstream_cert=None, upstream_key=None, upstream_server_name=None, state_dir="",
)  # fmt: skip


class _Stop(threading.Event):
    """A stop event whose backoff waits return at once and are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(float(timeout or 0))
        return self.is_set()


class _Fleet:
    def wait_for_clients(self, **_: object) -> list[object]:
        return []


def _serve(monkeypatch, *outcomes: Exception | RunSummary) -> tuple[object, _Stop, list[int]]:
    """``serve_upstream`` with ``run_client`` answering ``outcomes`` in turn (an exception is raised)."""
    calls: list[int] = []
    pending = list(outcomes)

    def run_client(*_: object, **__: object) -> RunSummary:
        calls.append(1)
        outcome = pending.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(upstream, "run_client", run_client)
    stop = _Stop()
    try:
        result: object = serve_upstream(CONFIG, object(), _Fleet(), stop, lambda report: None)  # type: ignore[arg-type]
    except RefusedUpstream as exc:
        result = exc
    return result, stop, calls


def test_transient_refusals_are_sat_out_with_a_growing_backoff(monkeypatch):
    unavailable = RpcFailed("Join", grpc.StatusCode.UNAVAILABLE, "connection refused")
    busy = RpcFailed("Join", grpc.StatusCode.RESOURCE_EXHAUSTED, "too many clients")
    result, stop, calls = _serve(
        monkeypatch, unavailable, busy, unavailable, RunSummary(rounds=3, client_id="eu")
    )
    assert result == (3, True) and len(calls) == 4
    assert stop.waits == [1.0, 2.0, 4.0]


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
    ],
)
def test_a_refusal_joining_again_cannot_change_ends_the_region_naming_it(monkeypatch, code):
    refusal = RpcFailed("Join", code, "base model mismatch: the client's base is abc")
    result, stop, calls = _serve(monkeypatch, refusal)
    assert (
        isinstance(result, RefusedUpstream) and result.code == code and len(calls) == 1 and stop.waits == []
    )
    assert str(result).startswith(
        f"region eu: the global coordinator at global:50051 refuses it ({code.name}: "
    )
    assert "base model mismatch: the client's base is abc" in str(result)


def test_another_process_under_the_regions_name_ends_it(monkeypatch):
    taken = IdentityConflict("PollTask", grpc.StatusCode.UNAUTHENTICATED, "session replaced", identity="eu")
    result, _, calls = _serve(monkeypatch, taken)
    assert (
        isinstance(result, RefusedUpstream)
        and result.code == grpc.StatusCode.UNAUTHENTICATED
        and len(calls) == 1
    )


def test_a_join_refused_because_the_global_run_is_over_ends_the_region_finished(monkeypatch):
    over = RpcFailed("Join", grpc.StatusCode.FAILED_PRECONDITION, "the run is over", reason=RUN_FINISHED)
    assert _serve(monkeypatch, over)[0] == (0, True)


def test_a_region_with_a_state_directory_keeps_its_upstream_state_there(monkeypatch, tmp_path):
    """Its WAN uplink's error feedback survives a restart as a client's does (``state_path``): a
    region killed and started again from its state directory sends what it would have sent
    (tests/sites: int8 WAN links, bit for bit)."""
    given: list[object] = []

    def run_client(*_: object, state_path: object = None, **__: object) -> RunSummary:
        given.append(state_path)
        return RunSummary(rounds=2, client_id="eu")

    monkeypatch.setattr(upstream, "run_client", run_client)
    for state_dir, want in ((str(tmp_path), tmp_path / "upstream.pt"), ("", None)):
        config = SimpleNamespace(**{**vars(CONFIG), "state_dir": state_dir})
        assert serve_upstream(config, object(), _Fleet(), _Stop(), lambda report: None) == (2, True)  # type: ignore[arg-type]
        assert given.pop() == want
