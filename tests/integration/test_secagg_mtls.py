"""SecAgg+ under mutual TLS: each client's advert key is bound to its certificate's identity
(``fedgrid.aggregation.secagg_identity``), the way ``fedgrid client --ca --cert --key`` runs."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from test_secagg import Checked, Dropping, Step, _state

from fedgrid.aggregation.secagg_crypto import PinnedKeys, SecAggRefusedError, read_advert
from fedgrid.aggregation.secagg_identity import CertificateKeyring, certificate_credential
from fedgrid.aggregation.secagg_server import SecAggServerRound
from fedgrid.client import start_client
from fedgrid.client.secagg import from_certificate
from fedgrid.client.secagg_party import SecAggParty
from fedgrid.ops import pki
from fedgrid.proto.tls import TLSFiles
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import RunIO, Schedule
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.types import TO_SERVER

from harness import wait_until

NAMES = [f"site-{i}" for i in range(5)]


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("secagg-certs")
    pki.init_ca(d)
    pki.issue(d, "coordinator", server=True)
    for name in NAMES:
        pki.issue(d, name)
    pki.init_ca(d / "other")
    pki.issue(d / "other", NAMES[1])  # the same name, from another CA
    return d


def _advert(certs: Path, name: str, *, ca: Path | None = None, claim: str | None = None) -> bytes:
    d = ca or certs
    signer = Ed25519PrivateKey.generate()
    identity, credential = certificate_credential(
        (d / f"{name}.pem").read_bytes(), (d / f"{name}.key").read_bytes(), signer
    )
    party = SecAggParty(
        client_name=claim or identity, signer=signer, keyring=PinnedKeys({}), credential=credential
    )
    srv = SecAggServerRound(
        run="r", server_round=1, participants=("a", "b"), k=1, graph_seed=b"g", threshold=1, bits=32
    )
    return party.advertise(srv.plan_for("a"))[TO_SERVER]


def test_an_advert_key_is_accepted_only_with_a_certificate_of_the_ca_for_its_identity(certs: Path) -> None:
    keyring = CertificateKeyring((certs / "ca.pem").read_bytes())
    check = dict(sender="a", run="r", server_round=1, keyring=keyring)
    assert read_advert(_advert(certs, NAMES[0]), **check).name == NAMES[0]  # type: ignore[arg-type]
    with pytest.raises(SecAggRefusedError, match="not signed by the CA"):
        read_advert(_advert(certs, NAMES[1], ca=certs / "other"), **check)  # type: ignore[arg-type]
    with pytest.raises(SecAggRefusedError, match="another identity's"):
        read_advert(_advert(certs, NAMES[2], claim=NAMES[3]), **check)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a client certificate"):
        _advert(certs, "coordinator")
    # A credential copied from another client's advert does not make its key the signer's.
    signer, thief = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    _, credential = certificate_credential(
        (certs / f"{NAMES[4]}.pem").read_bytes(), (certs / f"{NAMES[4]}.key").read_bytes(), signer
    )
    party = SecAggParty(client_name=NAMES[4], signer=thief, keyring=PinnedKeys({}), credential=credential)
    srv = SecAggServerRound(
        run="r", server_round=1, participants=("a", "b"), k=1, graph_seed=b"g", threshold=1, bits=32
    )
    with pytest.raises(SecAggRefusedError, match="does not verify"):
        read_advert(party.advertise(srv.plan_for("a"))[TO_SERVER], **check)  # type: ignore[arg-type]


def test_over_mutual_tls_the_sum_is_exact_with_certificate_identities(certs: Path) -> None:
    ca = (certs / "ca.pem").read_bytes()
    clients = []
    for i, name in enumerate(NAMES):
        wrapped = from_certificate(
            Step(name, 1 + i, {1: "fit"} if i == 0 else {}),
            ca_pem=ca,
            cert_pem=(certs / f"{name}.pem").read_bytes(),
            key_pem=(certs / f"{name}.key").read_bytes(),
        )
        clients.append(
            Dropping(
                wrapped.inner,
                signer=wrapped.party.signer,
                keyring=wrapped.party.keyring,
                identity=wrapped.party.client_name,
                credential=wrapped.party.credential,
            )
        )
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=30))
    tls = TLSFiles(str(certs / "ca.pem"), str(certs / "coordinator.pem"), str(certs / "coordinator.key"))
    server = Coordinator("127.0.0.1:0", fleet, max_workers=16, tls=tls).start()
    strategy = Checked(clients, bits=32, clip=0.5, seed=1)
    strategy.initialize(initial_state=_state())
    engine = RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=1,
            min_clients=len(NAMES),
            round_timeout=timedelta(seconds=60),
            join_timeout=timedelta(seconds=60),
            finish_timeout=timedelta(seconds=10),
        ),
        io=RunIO(
            events=fleet.events,
        ),
    )
    handles = [
        start_client(
            c,
            server.address,
            poll_wait_s=1.0,
            ca=str(certs / "ca.pem"),
            cert=str(certs / f"{c.name}.pem"),
            key=str(certs / f"{c.name}.key"),
            server_name="localhost",
        )  # fmt: skip
        for c in clients
    ]
    try:
        wait_until(lambda: len(fleet.live_clients()) == len(NAMES), timeout=30, what="clients to join")
        runner = threading.Thread(target=engine.run, daemon=True)
        runner.start()
        runner.join(timeout=120)
        assert not runner.is_alive()
        assert strategy.exact == [1]
        assert engine.history[0].extra["secagg_survivors"] == len(NAMES) - 1
        assert not torch.equal(strategy.global_state["w"], _state()["w"])
        for h in handles:
            h.join(timeout=30)
    finally:
        server.stop(grace=0.5)
        fleet.close()
