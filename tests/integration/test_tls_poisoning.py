"""The poisoning cases with mutual TLS on: two honest clients and two admitted attackers
(certificates of the federation's CA), over real handshakes on loopback. One attacker
claims 2**63 examples for an update of the constant 0.123 (its Join said 3), the other
uploads the finite value 3e38 everywhere under a norm bound. Both uploads are refused in
every round (each refusal is that round's failure: the attackers stay, as an honest client
refused once would), a process without a certificate cannot even connect, and the final
model equals, bit for bit, an in-process run of the two honest clients alone.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
import torch

from fedgrid.aggregation import build_strategy_from
from fedgrid.client import Client, FitOutput, start_client
from fedgrid.client.runtime import RpcFailed
from fedgrid.fleet.bounds import UpdateBounds
from fedgrid.ops import pki
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc
from fedgrid.proto.tls import TLSFiles
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import Schedule
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.simulation.fleet import InProcessFleet

from harness import wait_until

ROUNDS = 3


class Honest(Client):
    def __init__(self, name: str, k: int) -> None:
        self.name, self.k = name, k

    @property
    def num_examples(self) -> int:
        return 3

    def fit(self, state, ins):
        out = OrderedDict((n, v + 0.01 * self.k if v.is_floating_point() else v) for n, v in state.items())
        return FitOutput(out, num_examples=3, metrics={"loss": float(self.k)})


class Heavy(Honest):
    """Replaces the model with 0.123 and claims 2**63 examples (it reported 3 at Join)."""

    def fit(self, state, ins):
        out = OrderedDict(
            (n, torch.full_like(v, 0.123) if v.is_floating_point() else v) for n, v in state.items()
        )
        return FitOutput(out, num_examples=2**63, metrics={"loss": 0.0})


class Huge(Honest):
    """Uploads the finite value 3e38 everywhere."""

    def fit(self, state, ins):
        out = OrderedDict(
            (n, torch.full_like(v, 3e38) if v.is_floating_point() else v) for n, v in state.items()
        )
        return FitOutput(out, num_examples=3, metrics={"loss": 0.0})


def _initial():
    g = torch.Generator().manual_seed(11)
    return OrderedDict(
        [
            ("w", torch.randn(4, 3, generator=g)),
            ("b", torch.randn(4, generator=g)),
            ("steps", torch.tensor(7)),
        ]
    )


def _engine(fleet) -> RoundEngine:
    strategy = build_strategy_from("fedavg", seed=0)
    strategy.initialize(initial_state=_initial())
    return RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=ROUNDS,
            min_clients=2,
            round_timeout=timedelta(seconds=60),
            join_timeout=timedelta(seconds=60),
            finish_timeout=timedelta(seconds=10),
        ),
    )


def _files(d: Path, name: str) -> dict[str, str]:
    return {"ca": str(d / "ca.pem"), "cert": str(d / f"{name}.pem"), "key": str(d / f"{name}.key")}


def test_admitted_attackers_cannot_move_the_model_under_mtls(tmp_path):
    d = tmp_path / "pki"
    pki.init_ca(d)
    pki.issue(d, "coordinator", server=True)
    clients = [Honest("honest-1", 1), Honest("honest-2", 2), Heavy("heavy", 3), Huge("huge", 4)]
    for c in clients:
        pki.issue(d, c.name)
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=30), bounds=UpdateBounds(max_update_norm=1e6))
    tls = TLSFiles(
        str(d / "ca.pem"), str(d / "coordinator.pem"), str(d / "coordinator.key"), str(d / "crl.pem")
    )
    server = Coordinator("127.0.0.1:0", fleet, max_workers=16, tls=tls).start()
    engine = _engine(fleet)
    refusals: dict[str, list] = {c.name: [] for c in clients}
    handles = [
        start_client(
            c,
            server.address,
            poll_wait_s=1.0,
            on_event=lambda e, name=c.name: refusals[name].append(e) if e.kind == "error" else None,
            **_files(d, c.name),
        )
        for c in clients
    ]
    try:
        wait_until(lambda: len(fleet.live_clients()) == 4, timeout=30, what="clients to join")
        assert sorted(i.name for i in fleet.live_clients()) == [
            "heavy",
            "honest-1",
            "honest-2",
            "huge",
        ]  # certificate identities
        # A process without a certificate cannot even connect.
        channel = grpc.secure_channel(
            server.address, grpc.ssl_channel_credentials((d / "ca.pem").read_bytes())
        )
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.CoordinatorStub(channel).Join(pb.JoinRequest(name="anonymous", num_examples=3), timeout=5)
        channel.close()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and len(fleet.live_clients()) == 4
        runner = threading.Thread(target=engine.run, daemon=True)
        runner.start()
        runner.join(timeout=150)
        assert not runner.is_alive()
        errors = {}
        for c, h in zip(clients, handles):
            try:
                errors[c.name] = h.join(timeout=30).rounds
            except RpcFailed as exc:
                errors[c.name] = (exc.code, exc.details)
    finally:
        for h in handles:
            h.stop()
        server.stop(grace=0.5)
        fleet.close()
    assert errors == {"honest-1": ROUNDS, "honest-2": ROUNDS, "heavy": 0, "huge": 0}  # rounds that landed
    assert refusals["honest-1"] == refusals["honest-2"] == []
    assert [e.round for e in refusals["heavy"]] == [e.round for e in refusals["huge"]] == [1, 2, 3]
    assert all(
        "update refused: num_examples: 9223372036854775808 claimed" in e.detail for e in refusals["heavy"]
    )
    assert all("max_update_norm" in e.detail for e in refusals["huge"])
    assert all((m.clients_ok, m.clients_failed) == (2, 2) for m in engine.history)
    # The clean run: the two honest clients alone, in process.
    reference = _engine(InProcessFleet([Honest("honest-1", 1), Honest("honest-2", 2)]))
    for r in range(1, ROUNDS + 1):
        reference.commit(reference.run_round(r))
    for name, tensor in reference.strategy.global_state.items():
        assert torch.equal(engine.strategy.global_state[name], tensor), name
    assert not torch.equal(
        reference.strategy.global_state["w"], _initial()["w"]
    )  # the honest clients did move it
