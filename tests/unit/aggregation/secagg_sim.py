"""A SecAgg+ round driven by hand over ``SecAggParty`` and ``SecAggServerRound`` (no fleet):
the relay is a dict, and any client may drop after any step."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedgrid.aggregation.secagg_crypto import PinnedKeys, SecAggRefusedError
from fedgrid.aggregation.secagg_server import SecAggServerRound
from fedgrid.client.secagg_party import SecAggParty
from fedgrid.types import TO_SERVER

STAGES = ("advertise", "share", "mask", "unmask")


def relay(sent: dict[str, dict[str, bytes]]) -> dict[str, dict[str, bytes]]:
    """Inbox by recipient, sender -> payload (messages to the server left out)."""
    inbox: dict[str, dict[str, bytes]] = {}
    for sender, messages in sent.items():
        for to, payload in messages.items():
            if to != TO_SERVER:
                inbox.setdefault(to, {})[sender] = payload
    return inbox


@dataclass
class Federation:
    n: int
    k: int
    threshold: int
    bits: int = 32
    ids: list[str] = field(init=False)
    parties: dict[str, SecAggParty] = field(init=False)

    def __post_init__(self) -> None:
        self.ids = [f"c{i:03d}" for i in range(self.n)]
        signers = {cid: Ed25519PrivateKey.generate() for cid in self.ids}
        keyring = PinnedKeys({cid: s.public_key() for cid, s in signers.items()})
        self.parties = {
            cid: SecAggParty(client_name=cid, signer=signers[cid], keyring=keyring) for cid in self.ids
        }

    def server(self, server_round: int) -> SecAggServerRound:
        return SecAggServerRound(
            run="run-1",
            server_round=server_round,
            participants=tuple(self.ids),
            k=self.k,
            graph_seed=b"graph-%d" % server_round,
            threshold=self.threshold,
            bits=self.bits,
        )

    def run_round(
        self, server_round: int, inputs: dict[str, torch.Tensor], drops: dict[str, set[str]]
    ) -> tuple[torch.Tensor, list[str]]:
        """The unmasked ring sum and the survivors; a client in ``drops[stage]`` is gone from that step on."""
        srv = self.server(server_round)
        gone: set[str] = set()

        def live(stage: str) -> list[str]:
            gone.update(drops.get(stage, set()))
            return [cid for cid in self.ids if cid not in gone]

        sent = {cid: self.parties[cid].advertise(srv.plan_for(cid)) for cid in live("advertise")}
        srv.record_adverts({cid: m[TO_SERVER] for cid, m in sent.items()})
        inbox = relay(sent)
        shared = {}
        for cid in live("share"):
            self.parties[cid].receive_adverts(server_round, inbox.get(cid, {}))
            try:
                shared[cid] = self.parties[cid].share(server_round)
            except SecAggRefusedError:  # too few neighbours advertised: it cannot share, so it drops
                gone.add(cid)
        srv.record_shares(shared)
        inbox = relay(shared)
        masked = {}
        for cid in live("mask"):
            self.parties[cid].receive_shares(server_round, inbox.get(cid, {}))
            masked[cid] = self.parties[cid].mask(server_round, inputs[cid], bits=self.bits)
        alive, dropped = srv.unmask_request(list(masked))
        answers = {
            cid: self.parties[cid].unmask(server_round, survivors=alive, dropped=dropped)[TO_SERVER]
            for cid in live("unmask")
            if cid in alive
        }
        return srv.unmask(masked, answers, survivors=alive), alive


def random_drops(ids: list[str], rate: float, seed: int) -> dict[str, set[str]]:
    """``rate`` of the clients (at least one), drawn at random (seeded), each dropping before a
    step drawn at random."""
    rng = random.Random(seed)
    drops: dict[str, set[str]] = {stage: set() for stage in STAGES}
    for cid in rng.sample(ids, max(1, round(rate * len(ids)))):
        drops[rng.choice(STAGES)].add(cid)
    return drops
