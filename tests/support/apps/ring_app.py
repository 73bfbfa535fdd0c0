"""A test-only protocol with two message phases before fit, whose result is checked by hand.

Phase ``share``: the clients stand in a ring (sorted by name); each sends its seeded vector
``vector(name, round)`` to its two neighbours. Phase ``sum``: each client that received
sends the coordinator the sum of what it received. Then an ordinary FedAvg ``fit``.

``RingStrategy`` records, per round, what each client reported and what it should have
reported from the vectors its neighbours actually sent; a client that fails a phase is
dropped from the ring for the rest of the run. ``client`` is the ``--app`` of a deployed
client (the linear regression of ``linear_app``); ``client_drops_after_share`` kills its
own process as soon as its share phase is over (a crash between phases).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping, Sequence

import torch

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.client import TorchClient
from fedgrid.types import TO_SERVER, ClientInfo, Failure, FitIns, MessageIns, MessageRes

import linear_app

DIM = 8


def vector(name: str, server_round: int) -> torch.Tensor:
    """The vector client ``name`` shares in ``server_round`` (float64, seeded by both)."""
    seed = int.from_bytes(hashlib.sha256(f"{name}/{server_round}".encode()).digest()[:8], "little") >> 1
    return torch.randn(DIM, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _bytes(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


def _tensor(payload: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.float64)


def neighbours(ring: Sequence[str], me: str) -> list[str]:
    """The ring neighbours of ``me`` (left, then right; one when the ring has two)."""
    i = list(ring).index(me)
    left, right = ring[i - 1], ring[(i + 1) % len(ring)]
    return [left] if left == right else [left, right]


class RingStrategy(FedAvg):
    """FedAvg with the ring protocol before each fit (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dropped: set[str] = set()  # names
        #: round -> name -> (reported sum, expected sum from what its neighbours sent)
        self.report: dict[int, dict[str, tuple[list[float], list[float]]]] = {}
        #: round -> the ring (names) of the share phase
        self.rings: dict[int, list[str]] = {}
        self._share: dict[str, MessageRes] = {}  # by client id, the round's share phase
        self._names: dict[str, str] = {}

    def phases(self, *, server_round: int) -> Sequence[str]:
        return ("share", "sum", "fit")

    def configure_messages(
        self, *, server_round: int, phase: str, clients: Sequence[ClientInfo]
    ) -> list[tuple[ClientInfo, MessageIns]]:
        if phase == "share":
            ring = sorted((c for c in clients if c.name not in self.dropped), key=lambda c: c.sort_key)
            self.rings[server_round] = [c.name for c in ring]
        else:
            ring = [res.client for res in self._share.values()]
        self._names.update({c.client_id: c.name for c in ring})
        peers = tuple(c.client_id for c in ring)
        return [(c, MessageIns(round=server_round, phase=phase, peers=peers)) for c in ring]

    def receive_messages(
        self, *, server_round: int, phase: str, results: Sequence[MessageRes], failures: Sequence[Failure]
    ) -> dict[str, float]:
        self.dropped.update(f.client.name for f in failures)
        if phase == "share":
            self._share = {res.client.client_id: res for res in results}
            return {}
        report: dict[str, tuple[list[float], list[float]]] = {}
        for res in results:
            me = res.client.client_id
            expected = torch.zeros(DIM, dtype=torch.float64)
            for sender in self._share.values():  # in the phase's order, as the client summed them
                if me in sender.messages:
                    expected = expected + _tensor(sender.messages[me])
            report[res.client.name] = (_tensor(res.messages[TO_SERVER]).tolist(), expected.tolist())
        self.report[server_round] = report
        return {"ring_ok": float(all(got == want for got, want in report.values()))}

    def configure_round(
        self, *, server_round: int, clients: Sequence[ClientInfo]
    ) -> list[tuple[ClientInfo, FitIns]]:
        return super().configure_round(
            server_round=server_round, clients=[c for c in clients if c.name not in self.dropped]
        )

    def aggregate(
        self, *, server_round: int, results: Sequence[Any], failures: Sequence[Failure]
    ) -> dict[str, float]:
        self.dropped.update(f.client.name for f in failures)
        return super().aggregate(server_round=server_round, results=results, failures=failures)


class RingClient(TorchClient):
    """A linear-regression client that takes part in the ring."""

    _sum: torch.Tensor | None = None

    def exchange(self, ins: MessageIns) -> Mapping[str, bytes]:
        if ins.phase == "share":
            payload = _bytes(vector(self.name, ins.round))
            return {peer: payload for peer in neighbours(ins.peers, ins.client_id)}
        assert self._sum is not None, "sum phase before share"
        return {TO_SERVER: _bytes(self._sum)}

    def receive(self, ins: MessageIns, inbox: Mapping[str, bytes]) -> None:
        if ins.phase == "share":
            total = torch.zeros(DIM, dtype=torch.float64)
            for payload in inbox.values():
                total = total + _tensor(payload)
            self._sum = total


class GoneAfterShare(RingClient):
    """In simulation: gone once its first share phase is over (every later task fails)."""

    gone = False

    def receive(self, ins: MessageIns, inbox: Mapping[str, bytes]) -> None:
        super().receive(ins, inbox)
        if ins.phase == "share":
            self.gone = True

    def exchange(self, ins: MessageIns) -> Mapping[str, bytes]:
        if self.gone:
            raise ConnectionError("client gone")
        return super().exchange(ins)

    def fit(self, state, ins):  # type: ignore[no-untyped-def]
        if self.gone:
            raise ConnectionError("client gone")
        return super().fit(state, ins)


def _as(cls: type, partition: int, num_partitions: int, seed: int) -> TorchClient:
    c = linear_app.client(partition, num_partitions, seed)
    c.__class__ = cls
    return c


def client(partition: int, num_partitions: int, seed: int) -> TorchClient:
    return _as(RingClient, partition, num_partitions, seed)


def sim_client_gone_after_share(partition: int, num_partitions: int, seed: int) -> TorchClient:
    return _as(GoneAfterShare, partition, num_partitions, seed)


class CrashAfterShare(RingClient):
    def receive(self, ins: MessageIns, inbox: Mapping[str, bytes]) -> None:
        os._exit(17)  # a crash between phases: no Leave, no more heartbeats


def client_drops_after_share(partition: int, num_partitions: int, seed: int) -> TorchClient:
    return _as(CrashAfterShare, partition, num_partitions, seed)
