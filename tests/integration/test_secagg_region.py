"""``fedgrid region --secagg`` deployed: a global coordinator (gRPC, port 0), the region's real
``run_region`` (its own gRPC server on port 0, upstream as one client) and its clients (client
runtimes over gRPC). The region is the server of the inner SecAgg+ protocol: it learns only the
masked sum of its clients' inputs, and sends one update upstream, which becomes the global model.
With a client gone after its masked input, or after sharing its keys, the global model is the
plaintext weighted mean of the survivors' quantized updates; over mutual TLS too, the clients
taking part under their certificates' identities as ``fedgrid client --ca --cert --key`` does."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from test_secagg import Dropping, Step, _state

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.secagg import UNMASK
from fedgrid.aggregation.secagg_math import dequantize, ring_add, ring_scale
from fedgrid.client import start_client
from fedgrid.client.secagg import from_certificate, with_secagg
from fedgrid.config import load_config
from fedgrid.ops import pki
from fedgrid.region.region import run_region
from fedgrid.runlog import read_metrics
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import RunIO, Schedule
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.types import FIT, FitIns

CLIP = 0.5


def _clients(n: int, drop: str | None, certs: Path | None) -> list[Dropping]:
    """``n`` clients of 1..n examples; with ``drop``, the first is gone from that step of round 1 on.
    With ``certs``, each takes part under its client certificate's identity, as ``fedgrid client
    --ca --cert --key`` does (``from_certificate``); else under keys pinned in one keyring."""
    plain = [Step(f"c{i}", i + 1, {1: drop} if drop and i == 0 else {}) for i in range(n)]
    if certs is None:
        wrapped = with_secagg(plain)  # type: ignore[arg-type]
    else:
        ca = (certs / "ca.pem").read_bytes()
        wrapped = [
            from_certificate(
                c,
                ca_pem=ca,
                cert_pem=(certs / f"{c.name}.pem").read_bytes(),
                key_pem=(certs / f"{c.name}.key").read_bytes(),
            )
            for c in plain
        ]
    return [
        Dropping(
            c.inner, signer=c.party.signer, keyring=c.party.keyring,
            identity=c.party.client_name, credential=c.party.credential,
        )
        for c in wrapped
    ]  # fmt: skip


def _tls(certs: Path | None, name: str) -> dict[str, str]:
    if certs is None:
        return {}
    return {
        "ca": str(certs / "ca.pem"),
        "cert": str(certs / f"{name}.pem"),
        "key": str(certs / f"{name}.key"),
    }


def _run(tmp_path: Path, clients: list[Dropping], certs: Path | None) -> tuple[RoundEngine, Path]:
    """One global round: a global coordinator, the region ``eu`` under secagg (over mutual TLS
    with ``certs``) and ``clients`` joined to it; returns the global engine and the region's run
    directory."""
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=30))
    server = Coordinator("127.0.0.1:0", fleet, max_workers=8).start()
    strategy = FedAvg()
    strategy.initialize(initial_state=_state())
    engine = RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=1,
            min_clients=1,
            round_timeout=timedelta(seconds=60),
            join_timeout=timedelta(seconds=60),
            finish_timeout=timedelta(seconds=10),
        ),
        io=RunIO(
            events=fleet.events,
        ),
    )
    out = tmp_path / "eu"
    config = load_config(
        overrides={
            "secagg": True, "secagg_clip": CLIP, "upstream": server.address, "name": "eu",
            "listen": "127.0.0.1:0", "min_clients": len(clients), "out": str(out),
            **(_tls(certs, "eu-lan") if certs else {"insecure": True}),
        }
    )  # fmt: skip
    ready, stop = threading.Event(), threading.Event()
    trained: list[int] = []
    region = threading.Thread(target=lambda: trained.append(run_region(config, ready=ready, stop=stop)))
    region.start()
    handles = []
    try:
        assert ready.wait(30), "the region did not start"
        address = (out / "address").read_text().strip()
        handles = [
            start_client(
                c,
                address,
                poll_wait_s=1.0,
                **_tls(certs, c.name),
                **({"server_name": "localhost"} if certs else {}),
            )
            for c in clients
        ]
        runner = threading.Thread(target=engine.run, daemon=True)
        runner.start()
        runner.join(timeout=120)
        assert not runner.is_alive(), "the global round did not end"
        region.join(timeout=60)
        assert trained == [1]
    finally:
        stop.set()
        region.join(timeout=30)
        for h in handles:
            h.join(timeout=30)
        server.stop(grace=0.5)
        fleet.close()
    return engine, out


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("region-certs")
    pki.init_ca(d)
    pki.issue(d, "eu-lan", server=True)
    for i in range(4):
        pki.issue(d, f"c{i}")
    return d


@pytest.mark.parametrize(
    "n, drop, mtls", [(3, None, False), (4, UNMASK, False), (4, FIT, False), (4, FIT, True)]
)
def test_a_region_aggregates_securely_inside_and_sends_one_update_upstream(
    tmp_path: Path, certs: Path, n: int, drop: str | None, mtls: bool
) -> None:
    clients = _clients(n, drop, certs if mtls else None)
    engine, out = _run(tmp_path, clients, certs if mtls else None)
    (regional,) = read_metrics(out)
    # Gone after its masked input (unmask): still a survivor; gone before it (fit): dropped.
    survivors = [c for c in clients if c.inner.drop.get(1) != FIT]  # type: ignore[attr-defined]
    assert regional["secagg_aborted"] == 0.0
    assert regional["secagg_survivors"] == len(survivors)
    assert regional["secagg_dropped"] == (1.0 if drop == FIT else 0.0)
    # The region saw only masked inputs; the plaintext ring sum is the survivors' own integers.
    total = torch.zeros(16, dtype=torch.int64)
    for c in survivors:
        assert c.last_input is not None
        total = ring_add(total, c.last_input, bits=32)
    examples = [c.num_examples for c in clients]  # all of them shared keys: the round's weights
    share = sum(c.num_examples for c in survivors) / sum(examples)
    mean = dequantize(total, scale=ring_scale(bits=32, clip=CLIP, clients=n), bits=32) / share
    start = _state()
    (upstream,) = engine.history  # one update upstream: the region is one client of the global round
    assert upstream.clients_ok == 1 and upstream.extra["examples"] == sum(c.num_examples for c in survivors)
    model = engine.strategy.global_state
    assert torch.equal(model["w"], (start["w"].double() + mean[:12].view(3, 4)).float())
    assert torch.allclose(model["b"], start["b"] + mean[12:], rtol=0, atol=1e-15)  # the global mean of one
    assert torch.equal(model["steps"], start["steps"])
    # And within the quantization's steps of the survivors' float weighted mean.
    fits = [c.inner.fit(start, FitIns(round=1)) for c in survivors]
    plain = sum(f.state["w"].double() * f.num_examples for f in fits) / sum(f.num_examples for f in fits)
    step = 1 / ring_scale(bits=32, clip=CLIP, clients=n)  # a ring step, in units of the mean
    assert float((model["w"].double() - plain).abs().max()) <= n * step / share + 1e-7  # and float32


def test_a_region_refuses_the_phases_of_secure_aggregation_across_regions() -> None:
    from fedgrid.aggregation.secagg import ADVERTISE
    from fedgrid.region.region import RegionClient
    from fedgrid.simulation.fleet import InProcessFleet
    from fedgrid.types import MessageIns

    engine = RoundEngine(
        strategy=FedAvg(),
        fleet=InProcessFleet([Step("c0", 1, {})]),
        schedule=Schedule(
            rounds=0,
            min_clients=1,
            round_timeout=timedelta(seconds=10),
            join_timeout=timedelta(seconds=10),
        ),
    )
    region = RegionClient(engine, name="eu", regional_rounds=1)
    with pytest.raises(
        ValueError, match="message phase 'secagg-advertise'; a region sends its regional model whole"
    ):
        region.exchange(MessageIns(round=1, phase=ADVERTISE, peers=("a", "b")))
