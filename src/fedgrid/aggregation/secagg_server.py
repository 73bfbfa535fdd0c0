"""The coordinator's side of one SecAgg+ round, with no I/O: who advertised (U1), who shared
(U2), who sent a masked input (U3), what to ask in the unmask step, and the sum of the
survivors' inputs from the shares returned.

The sum is exact in the ring: the survivors' masked inputs added, their self masks (rebuilt
from ``threshold`` shares of each self-mask seed) taken off, and the pairwise masks they share
with clients that dropped after sharing (rebuilt from ``threshold`` shares of each dropped
client's mask key) taken off. Fewer survivors or shares than the threshold abort the round
with ``SecAggAbortedError`` and no partial sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedgrid.aggregation.secagg_crypto import (
    KEY,
    SELF,
    Advert,
    SecAggRefusedError,
    decode_unmask,
    mask_seed,
    unpack_fields,
)
from fedgrid.aggregation.secagg_math import (
    RoundPlan,
    SecAggAbortedError,
    combine_shares,
    mask_sign,
    neighbours,
    prg,
    ring_add,
)

__all__ = ["SecAggServerRound"]


def _parse_advert(sender: str, payload: bytes) -> Advert | None:
    """The keys of an advert as sent to the coordinator (the clients check the signatures)."""
    try:
        body, _ = unpack_fields(payload[5:], 2)
        cid, name, cipher, mask, _ = unpack_fields(body, 5)
    except SecAggRefusedError:
        return None
    if cid.decode(errors="replace") != sender or len(cipher) != 32 or len(mask) != 32:
        return None
    return Advert(sender, name.decode(errors="replace"), cipher, mask)


@dataclass
class SecAggServerRound:
    """One round's bookkeeping; ``participants`` are the selected client ids, in order."""

    run: str
    server_round: int
    participants: tuple[str, ...]
    k: int
    graph_seed: bytes
    threshold: int
    bits: int
    adverts: dict[str, Advert] = field(default_factory=dict)
    sent_to: dict[str, set[str]] = field(default_factory=dict)  # U2: who sent shares to whom
    graph: dict[str, list[str]] = field(init=False)

    def __post_init__(self) -> None:
        self.graph = neighbours(list(self.participants), k=self.k, seed=self.graph_seed)

    def plan_for(self, client_id: str) -> RoundPlan:
        return RoundPlan(
            run=self.run,
            server_round=self.server_round,
            me=client_id,
            participants=self.participants,
            k=self.k,
            graph_seed=self.graph_seed,
            threshold=self.threshold,
        )

    def record_adverts(self, sent: Mapping[str, bytes]) -> None:
        """The adverts sent to the coordinator, by sender (U1: those that parse)."""
        for sender, payload in sent.items():
            advert = _parse_advert(sender, payload) if sender in self.graph else None
            if advert is not None:
                self.adverts[sender] = advert

    def record_shares(self, sent: Mapping[str, Mapping[str, bytes]]) -> None:
        """The share phase's messages by sender (U2: the advertised senders), recipients kept."""
        for sender, messages in sent.items():
            if sender in self.adverts:
                self.sent_to[sender] = {r for r in messages if r in self.graph.get(sender, ())}

    def masked_with(self, a: str, b: str) -> bool:
        """Whether ``a`` added a pairwise mask with ``b`` (``b``'s shares reached it)."""
        return a in self.sent_to.get(b, ())

    def unmask_request(self, survivors: Sequence[str]) -> tuple[list[str], list[str]]:
        """Who to name survivors and dropouts in the unmask step, from the masked inputs received.

        Raises:
            SecAggAbortedError: fewer survivors than the threshold.
        """
        alive = [cid for cid in self.participants if cid in survivors and cid in self.sent_to]
        if len(alive) < self.threshold:
            raise SecAggAbortedError(
                f"round {self.server_round}: {len(alive)} masked inputs, fewer than the threshold "
                f"{self.threshold}: the round aborts"
            )
        gone = [cid for cid in self.participants if cid in self.sent_to and cid not in alive]
        return alive, gone

    def _shares(
        self, answers: Mapping[str, bytes], alive: set[str], gone: set[str]
    ) -> dict[tuple[str, bytes], list[bytes]]:
        """The shares in the unmask answers, each from a client that holds one of its owner's."""
        found: dict[tuple[str, bytes], list[bytes]] = {}
        for holder, payload in answers.items():
            try:
                entries = decode_unmask(payload)
            except (SecAggRefusedError, ValueError):
                continue  # a malformed answer counts as none
            for owner, kind, share in entries:
                wanted = (kind == SELF and owner in alive) or (kind == KEY and owner in gone)
                if wanted and self.masked_with(holder, owner):
                    found.setdefault((owner, kind), []).append(share)
        return found

    def _secret(self, found: Mapping[tuple[str, bytes], list[bytes]], owner: str, kind: bytes) -> bytes:
        what = "self-mask seed" if kind == SELF else "mask key"
        try:
            return combine_shares(found.get((owner, kind), []), threshold=self.threshold)
        except SecAggAbortedError as exc:
            raise SecAggAbortedError(
                f"round {self.server_round}: cannot rebuild the {what} of {owner[:64]!r} ({exc}): the round aborts"
            ) from None
        except ValueError as exc:
            raise SecAggAbortedError(
                f"round {self.server_round}: a bad share of {owner[:64]!r}: {exc}"
            ) from None

    def unmask(
        self, masked: Mapping[str, torch.Tensor], answers: Mapping[str, bytes], *, survivors: Sequence[str]
    ) -> torch.Tensor:
        """The ring sum (int64) of the survivors' inputs.

        Args:
            masked: each survivor's masked input (ring elements, int64, one length).
            answers: the unmask answers, by sender.
            survivors: who the unmask request named survivors (``unmask_request``).

        Raises:
            SecAggAbortedError: a survivor's input missing, or too few shares of a secret.
        """
        alive, gone = set(survivors), {cid for cid in self.sent_to if cid not in survivors}
        missing = alive - set(masked)
        if missing:
            raise SecAggAbortedError(
                f"round {self.server_round}: {len(missing)} survivors' inputs are missing"
            )
        found = self._shares(answers, alive, gone)
        order = [cid for cid in self.participants if cid in alive]
        length = masked[order[0]].numel()
        total = torch.zeros(length, dtype=torch.int64)
        for cid in order:
            total = ring_add(total, masked[cid], bits=self.bits)
        # Rebuild every secret before subtracting anything: a failure leaves no partial sum.
        seeds = {cid: self._secret(found, cid, SELF) for cid in order}
        keys = {
            cid: self._secret(found, cid, KEY) for cid in gone if any(self.masked_with(i, cid) for i in order)
        }
        for cid in order:
            total = ring_add(total, prg(seeds[cid], length, bits=self.bits), bits=self.bits, sign=-1)
        for cid, raw in keys.items():
            key = X25519PrivateKey.from_private_bytes(raw)
            for peer in order:
                if not self.masked_with(peer, cid):
                    continue
                seed = mask_seed(key, self.adverts[peer].mask, run=self.run, server_round=self.server_round)
                total = ring_add(
                    total, prg(seed, length, bits=self.bits), bits=self.bits, sign=-mask_sign(peer, cid)
                )
        return total
