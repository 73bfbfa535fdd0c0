"""A SecAgg+ client's side of one round, as a state machine with no I/O: advertise keys, share
them, mask the input, answer one unmask request. ``fedgrid.client.secagg`` (``SecAggClient``)
runs it over the wire; what both sides of a round share (``RoundPlan``, the unmask answer's
form) and the arithmetic stay in ``fedgrid.aggregation``.

It refuses, raising ``SecAggRefusedError`` and returning nothing, whatever could reveal both
shares of one client (its self-mask seed, which unmasks its input, and its mask key, which
strips its pairwise masks) or comes from someone it cannot authenticate:

- a round whose threshold is not a majority of its neighbourhood (each holder reveals one of
  a client's two shares, so a majority threshold keeps both from being rebuilt);
- an unmask request whose survivor and dropout sets overlap, that names ids not in the round,
  that names fewer survivors than the threshold, that says this client dropped, or that comes
  before this client sent its masked input;
- a second unmask request in the same round;
- an advert that is unsigned, forged (signature, identity, run or round) or relayed under
  another client's id;
- a share envelope that does not open: tampered, or replayed from another round or run.

Once it refused, the round is over for this client: every later request of the round is
refused too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedgrid.aggregation.secagg_crypto import (
    KEY,
    SELF,
    Advert,
    Keyring,
    SecAggRefusedError,
    encode_unmask,
    make_advert,
    mask_seed,
    open_sealed,
    pack_fields,
    raw_private,
    raw_public,
    read_advert,
    seal,
    unpack_fields,
)
from fedgrid.aggregation.secagg_math import RoundPlan, mask_sign, prg, ring_add, share_secret
from fedgrid.types import TO_SERVER

__all__ = ["SecAggParty"]


@dataclass
class _Round:
    plan: RoundPlan
    cipher: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate)
    mask: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate)
    self_seed: bytes = field(default_factory=lambda: os.urandom(32))
    adverts: dict[str, Advert] = field(default_factory=dict)
    held: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)  # owner -> (self share, key share)
    masked: bool = False
    unmask_asked: bool = False
    refused: str = ""


class SecAggParty:
    """One client's SecAgg+ rounds.

    Args:
        client_name: the identity its adverts claim (its certificate's name).
        signer: the identity's Ed25519 key.
        keyring: the Ed25519 keys of the identities it accepts adverts from.
        credential: what proves ``signer``'s key for ``client_name`` to a peer's keyring
            (``secagg_identity.certificate_credential``); empty for pinned keys.
    """

    def __init__(
        self, *, client_name: str, signer: Ed25519PrivateKey, keyring: Keyring, credential: bytes = b""
    ) -> None:
        self.client_name = client_name
        self.signer = signer
        self.keyring = keyring
        self.credential = credential
        self._round: _Round | None = None

    def _current(self, server_round: int, step: str) -> _Round:
        r = self._round
        if r is None or r.plan.server_round != server_round:
            raise SecAggRefusedError(f"round {server_round}: {step} before this client advertised its keys")
        if r.refused:
            raise SecAggRefusedError(
                f"round {server_round}: refused earlier ({r.refused}); {step} refused too"
            )
        return r

    def _refuse(self, r: _Round, reason: str) -> SecAggRefusedError:
        r.refused = r.refused or reason
        return SecAggRefusedError(f"round {r.plan.server_round}: {reason}")

    def advertise(self, plan: RoundPlan) -> dict[str, bytes]:
        """Fresh keys for ``plan``'s round, signed, to each neighbour and to the coordinator."""
        if plan.me not in plan.participants:
            raise SecAggRefusedError(f"round {plan.server_round}: this client is not among the participants")
        near = len(plan.neighbours())
        if 2 * plan.threshold <= near:
            # Each holder answers one request, with one of a client's two shares: only a
            # majority threshold keeps a coordinator from collecting enough of both.
            raise SecAggRefusedError(
                f"round {plan.server_round}: threshold {plan.threshold} is not a majority of the {near} "
                "neighbours: a coordinator could collect both shares of one client"
            )
        r = self._round = _Round(plan)
        advert = Advert(plan.me, self.client_name, raw_public(r.cipher), raw_public(r.mask), self.credential)
        payload = make_advert(self.signer, advert=advert, run=plan.run, server_round=plan.server_round)
        return {**{peer: payload for peer in plan.neighbours()}, TO_SERVER: payload}

    def receive_adverts(self, server_round: int, inbox: Mapping[str, bytes]) -> None:
        """The neighbours' adverts, each checked (``read_advert``); one that fails refuses the round."""
        r = self._current(server_round, "receiving adverts")
        near = set(r.plan.neighbours())
        for sender, payload in inbox.items():
            if sender not in near:
                raise self._refuse(r, f"an advert relayed from {sender[:64]!r}, not a neighbour")
            try:
                r.adverts[sender] = read_advert(
                    payload, sender=sender, run=r.plan.run, server_round=server_round, keyring=self.keyring
                )
            except SecAggRefusedError as exc:
                raise self._refuse(r, str(exc)) from None

    def share(self, server_round: int) -> dict[str, bytes]:
        """Shamir shares of the self-mask seed and of the mask key, one envelope per advertised neighbour."""
        r = self._current(server_round, "sharing keys")
        holders = [p for p in r.plan.neighbours() if p in r.adverts]
        if len(holders) < r.plan.threshold:
            raise self._refuse(
                r, f"{len(holders)} neighbours advertised keys, fewer than the threshold {r.plan.threshold}"
            )
        xs = list(range(1, len(holders) + 1))
        self_shares = share_secret(r.self_seed, threshold=r.plan.threshold, xs=xs)
        key_shares = share_secret(raw_private(r.mask), threshold=r.plan.threshold, xs=xs)
        out: dict[str, bytes] = {}
        for x, peer in zip(xs, holders):
            body = pack_fields(r.plan.me.encode(), peer.encode(), self_shares[x], key_shares[x])
            out[peer] = seal(
                r.cipher,
                r.adverts[peer].cipher,
                body,
                sender=r.plan.me,
                receiver=peer,
                run=r.plan.run,
                server_round=server_round,
            )
        return out

    def receive_shares(self, server_round: int, inbox: Mapping[str, bytes]) -> None:
        """The envelopes of the neighbours that shared: opened and kept; one that does not open
        (tampered, replayed from another round or run) refuses the round."""
        r = self._current(server_round, "receiving shares")
        for sender, envelope in inbox.items():
            advert = r.adverts.get(sender)
            if advert is None:
                raise self._refuse(r, f"an envelope from {sender[:64]!r}, who sent this client no advert")
            try:
                body = open_sealed(
                    r.cipher, advert.cipher, envelope, sender=sender, receiver=r.plan.me,
                    run=r.plan.run, server_round=server_round,
                )  # fmt: skip
                owner, receiver, self_share, key_share = unpack_fields(body, 4)
            except SecAggRefusedError as exc:
                raise self._refuse(r, str(exc)) from None
            if owner.decode() != sender or receiver.decode() != r.plan.me:
                raise self._refuse(r, f"an envelope from {sender[:64]!r} holds shares of another client")
            r.held[sender] = (self_share, key_share)

    def threshold(self, server_round: int) -> int:
        """The threshold of ``server_round`` this client advertised under (the fewest survivors it
        unmasks for: what its share of distributed DP noise is sized for)."""
        return self._current(server_round, "DP noise").plan.threshold

    def mask(self, server_round: int, values: torch.Tensor, *, bits: int) -> torch.Tensor:
        """``values`` (ring elements, int64) plus the self mask and the pairwise masks with each
        neighbour that shared (its envelope was received)."""
        r = self._current(server_round, "masking")
        if r.unmask_asked:
            raise self._refuse(r, "masking after an unmask request")
        out = ring_add(values, prg(r.self_seed, values.numel(), bits=bits), bits=bits)
        for peer in r.held:
            seed = mask_seed(r.mask, r.adverts[peer].mask, run=r.plan.run, server_round=server_round)
            out = ring_add(
                out, prg(seed, values.numel(), bits=bits), bits=bits, sign=mask_sign(r.plan.me, peer)
            )
        r.masked = True
        return out

    def unmask(
        self, server_round: int, *, survivors: Sequence[str], dropped: Sequence[str]
    ) -> dict[str, bytes]:
        """The shares the coordinator needs: the self-mask share of each surviving neighbour,
        the mask-key share of each dropped one; refused (nothing returned) on a bad request."""
        r = self._current(server_round, "unmasking")
        if r.unmask_asked:
            raise self._refuse(r, "a second unmask request in the same round")
        r.unmask_asked = True
        alive, gone = set(survivors), set(dropped)
        if len(alive) != len(survivors) or len(gone) != len(dropped):
            raise self._refuse(r, "the unmask request repeats an id")
        if alive & gone:
            raise self._refuse(r, f"survivors and dropouts overlap ({len(alive & gone)} ids)")
        unknown = (alive | gone) - set(r.plan.participants)
        if unknown:
            raise self._refuse(r, f"the unmask request names {len(unknown)} ids not in the round")
        if len(alive) < r.plan.threshold:
            raise self._refuse(r, f"{len(alive)} survivors, fewer than the threshold {r.plan.threshold}")
        if r.plan.me not in alive or not r.masked:
            raise self._refuse(
                r, "the unmask request counts this client a survivor but it sent no masked input"
            )
        entries = [(o, SELF, s[0]) for o, s in r.held.items() if o in alive]
        entries += [(o, KEY, s[1]) for o, s in r.held.items() if o in gone]
        return {TO_SERVER: encode_unmask(entries)}
