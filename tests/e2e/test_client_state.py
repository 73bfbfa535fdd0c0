"""A client's error-feedback state survives a restart of its run loop (``state_path``).

A real gRPC coordinator (port 0) with a ``topk`` uplink; the client runs in a background
thread (``fedgrid.client.start``). Rounds are driven one at a time through the fleet, and
every update the coordinator reconstructs is compared bit for bit with an in-process
reference: the same client and ``UplinkEncoder`` running without interruption.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Iterator, Mapping

import pytest
import torch

from fedgrid.aggregation.updates import as_model
from fedgrid.client import Client, FitOutput
from fedgrid.client import start_client as start  # harness.start_client starts a process
from fedgrid.client.state import STATE_FORMAT
from fedgrid.client.uplink import UplinkEncoder, reconstruct
from fedgrid.compression.spec import CodecSpec
from fedgrid.fleet.codec_policy import CodecPolicy
from fedgrid.proto import serde
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.types import ClientInfo, FitIns, ModelState

from harness import wait_until

CODEC = "topk:0.1"


class Drifting(Client):
    """Adds a seeded random step; the seed depends on its own count of fits (state of its own)."""

    def __init__(self) -> None:
        self.name = "drifting"
        self.fits = 0

    @property
    def num_examples(self) -> int:
        return 4

    def fit(self, state, ins):
        self.fits += 1
        g = torch.Generator().manual_seed(1000 * ins.round + self.fits)
        out = OrderedDict(
            (k, v + torch.randn(v.shape, generator=g) if v.is_floating_point() else v + 1)
            for k, v in state.items()
        )
        return FitOutput(out, 4)

    def state_dict(self) -> dict[str, Any]:
        return {"fits": self.fits}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.fits = int(state["fits"])


def _initial() -> ModelState:
    g = torch.Generator().manual_seed(0)
    return OrderedDict(
        w=torch.randn(20, 10, generator=g), b=torch.randn(10, generator=g), steps=torch.tensor(0)
    )


def _reference(
    rounds: int, *, client: Drifting | None = None, encoder: UplinkEncoder | None = None
) -> tuple[list[ModelState], UplinkEncoder]:
    """The global model after each round of one uninterrupted client, and its encoder."""
    client, encoder = client or Drifting(), encoder or UplinkEncoder(CodecSpec.parse(CODEC))
    models, g = [], _initial()
    for r in range(1, rounds + 1):
        out = client.fit(g, FitIns(round=r))
        encoded, delta = encoder.encode(global_state=g, new_state=out.state)
        _, received = serde.decode_chunks(list(encoded.frames(serde.StreamInfo(round=r, delta=delta))))
        g = reconstruct(g, received, delta=delta)
        models.append(g)
    return models, encoder


class Server:
    """A coordinator whose rounds the test drives one by one, for one named client."""

    def __init__(self) -> None:
        self.fleet = RemoteFleet(
            heartbeat_interval=timedelta(seconds=30), codec_policy=CodecPolicy(CodecSpec.parse(CODEC))
        )
        self.coordinator = Coordinator("127.0.0.1:0", self.fleet, max_workers=16).start()
        self.address = self.coordinator.address
        self.known: set[str] = set()

    def joined(self) -> ClientInfo:
        """Waits for a client that was not there before and returns it."""
        new: list[ClientInfo] = []

        def found() -> bool:
            new[:] = [c for c in self.fleet.live_clients() if c.client_id not in self.known]
            return bool(new)

        wait_until(found, timeout=30, what="a client to join")
        self.known.add(new[0].client_id)
        return new[0]

    def fit(self, server_round: int, state: ModelState, info: ClientInfo) -> ModelState:
        outcome = self.fleet.fit_round(
            server_round=server_round,
            global_state=state,
            assignments=[(info, FitIns(round=server_round))],
            timeout=timedelta(seconds=60),
        )
        assert not outcome.failures, outcome.failures
        # A lossy uplink's result holds the difference (FitRes.delta): the model is the global one plus it.
        update = OrderedDict((k, v.clone()) for k, v in as_model(state, outcome.results[0]).state.items())
        self.fleet.committed(server_round)
        return update

    def stop(self) -> None:
        self.coordinator.stop(grace=0.5)
        self.fleet.close()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.stop()


def _saved_round(path) -> int:
    """The round of the state on disk; 0 while there is none (or only the corrupt one a test planted)."""
    try:
        return int(torch.load(path, weights_only=True)["round"])
    except Exception:
        return 0


def _assert_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_restarted_client_resumes_its_residuals(server, tmp_path, caplog):
    path = tmp_path / "state" / "client-0.pt"
    expected, _ = _reference(3)
    _, after_two = _reference(2)
    caplog.set_level(logging.INFO, logger="fedgrid.client")

    handle = start(Drifting(), server.address, poll_wait_s=1.0, state_path=path)
    info = server.joined()
    g = _initial()
    for r in (1, 2):
        g = server.fit(r, g, info)
        _assert_equal(g, expected[r - 1])
        wait_until(lambda: _saved_round(path) == r, timeout=30, what=f"state of round {r} on disk")
    handle.stop()
    assert handle.join(timeout=30).rounds == 2

    saved = torch.load(path, weights_only=True)
    assert (saved["format"], saved["run_id"], saved["name"], saved["client"]) == (
        STATE_FORMAT,
        server.fleet.run_id,
        "drifting",
        {"fits": 2},
    )
    residuals = saved["uplink"][CODEC]["feedback"]["residuals"]
    _assert_equal(residuals, after_two.feedback.residuals)
    assert all(
        float(t.abs().sum()) > 0 for t in residuals.values()
    )  # topk:0.1 left most of each update behind

    # A new loop (a new client object, as after a process restart) with the same file.
    handle = start(Drifting(), server.address, poll_wait_s=1.0, state_path=path)
    info = server.joined()
    g = server.fit(3, g, info)
    _assert_equal(g, expected[2])  # the restored residual and fit count made exactly the uninterrupted update
    wait_until(lambda: _saved_round(path) == 3, timeout=30, what="state of round 3 on disk")
    handle.stop()
    assert handle.join(timeout=30).rounds == 1
    assert "restored client state of round 2" in caplog.text

    # Without the saved state round 3 would have been another update: the check above can fail.
    fresh_client, fresh = Drifting(), UplinkEncoder(CodecSpec.parse(CODEC))
    encoded, delta = fresh.encode(
        global_state=expected[1], new_state=fresh_client.fit(expected[1], FitIns(round=3)).state
    )
    _, received = serde.decode_chunks(list(encoded.frames(serde.StreamInfo(round=3, delta=delta))))
    assert not torch.equal(reconstruct(expected[1], received, delta=delta)["w"], g["w"])


@pytest.mark.parametrize("kind", ["another-run", "corrupt"])
def test_foreign_or_corrupt_state_is_logged_and_ignored(server, tmp_path, caplog, kind):
    path = tmp_path / "client-0.pt"
    if kind == "corrupt":
        path.write_bytes(b"\x80\x02 this is not a client state")
    else:
        _, stale = _reference(2)
        torch.save(
            {
                "format": STATE_FORMAT,
                "run_id": "another-run",
                "round": 2,
                "name": "drifting",
                "uplink": {CODEC: stale.state_dict()},
                "client": {"fits": 2},
            },
            path,
        )
    expected, _ = _reference(1)
    caplog.set_level(logging.INFO, logger="fedgrid.client")

    handle = start(Drifting(), server.address, poll_wait_s=1.0, state_path=path)
    info = server.joined()
    g = server.fit(1, _initial(), info)
    _assert_equal(g, expected[0])  # as a client with no saved state
    wait_until(lambda: _saved_round(path) == 1, timeout=30, what="the state file to be replaced")
    handle.stop()
    assert handle.join(timeout=30).rounds == 1

    if kind == "corrupt":
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and f"client state {path} is unreadable, ignoring it" in errors[0]
    else:
        assert (
            f"client state {path} is from run another-run, the coordinator runs {server.fleet.run_id}: starting afresh"
            in caplog.text
        )
    assert "restored client state" not in caplog.text
    saved = torch.load(path, weights_only=True)
    assert (saved["run_id"], saved["round"], saved["client"]) == (server.fleet.run_id, 1, {"fits": 1})


def test_cli_client_saves_its_state_in_state_dir(tmp_path):
    """``fedgrid client --state-dir DIR`` against a ``fedgrid coordinator --codec topk:0.01`` process."""
    import re

    from harness import start_client, start_coordinator

    proc, address = start_coordinator(
        tmp_path / "coord", "--rounds", "2", "--codec", "topk:0.01", "--min-clients", "1"
    )
    client = start_client(
        address, tmp_path / "c.log", "--partition", "1/3", "--state-dir", str(tmp_path / "state")
    )
    try:
        assert client.wait(timeout=180) == 0, (tmp_path / "c.log").read_text()[-2000:]
        assert proc.wait(timeout=60) == 0
    finally:
        for p in (proc, client):
            if p.poll() is None:
                p.kill()
    run_id = re.search(r"\(run ([0-9a-f]+),", (tmp_path / "coord.coordinator.log").read_text())
    assert run_id is not None
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["client-1.pt"]
    saved = torch.load(tmp_path / "state" / "client-1.pt", weights_only=True)
    assert (saved["format"], saved["run_id"], saved["round"]) == (STATE_FORMAT, run_id.group(1), 2)
    residuals = saved["uplink"]["topk:0.01"]["feedback"]["residuals"]
    assert residuals and all(float(t.abs().sum()) > 0 for t in residuals.values() if t.numel() > 1)
    assert set(saved["client"]) == {  # TorchClient's own state
        "scaffold",
        "inner_optimizer",
        "lookahead",
        "diloco_replica",
        "replica",
    }
