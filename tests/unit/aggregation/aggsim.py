"""Deterministic fake clients for strategy tests: each 'trains' by a seeded perturbation.

A client's answer depends only on (its name, the round, the tensors it was sent), so two
runs that send the same tensors get the same answers: what the resume tests rely on.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from fedgrid.aggregation import CONTROL_DELTA_PREFIX, Strategy
from fedgrid.seeding import derive_seed
from fedgrid.types import ClientInfo, FitIns, FitRes, ModelState


def model_state() -> "OrderedDict[str, torch.Tensor]":
    """A small model with module-like names, a float64 tensor and an integer buffer."""
    gen = torch.Generator().manual_seed(0)
    return OrderedDict(
        [
            ("enc.weight", torch.randn(4, 3, generator=gen)),
            ("enc.bias", torch.randn(4, generator=gen)),
            ("bn.running_mean", torch.zeros(4, dtype=torch.float64)),
            ("bn.num_batches_tracked", torch.tensor(0, dtype=torch.int64)),
            ("head.weight", torch.randn(2, 4, generator=gen)),
            ("head.bias", torch.randn(2, generator=gen)),
        ]
    )


def clients(n: int, *, memory: Sequence[int] | None = None) -> list[ClientInfo]:
    return [
        ClientInfo(
            client_id=f"id-{i}",
            name=f"c{i:02d}",
            num_examples=10 + 3 * i,
            memory_bytes=(memory[i] if memory else 0),
        )
        for i in range(n)
    ]


def fake_fit(client: ClientInfo, ins: FitIns, sent: ModelState, *, scale: float = 0.1) -> FitRes:
    """A result for ``ins``: the tensors it expects (default: the model) near what was sent."""
    gen = torch.Generator().manual_seed(derive_seed("fit", client.name, ins.round))
    names = (
        list(ins.expected) if ins.expected is not None else [n for n in sent if not n.startswith("scaffold.")]
    )
    out: ModelState = OrderedDict()
    for name in names:
        if name.startswith(CONTROL_DELTA_PREFIX):
            ref = sent[name[len(CONTROL_DELTA_PREFIX) :]]
            out[name] = (torch.randn(ref.shape, generator=gen, dtype=torch.float64) * scale).to(ref.dtype)
        elif sent[name].dtype.is_floating_point:
            noise = torch.randn(sent[name].shape, generator=gen, dtype=torch.float64) * scale + 0.05
            out[name] = (sent[name].to(torch.float64) + noise).to(sent[name].dtype)
        else:
            out[name] = sent[name] + int(torch.randint(1, 4, (), generator=gen))
    return FitRes(
        client,
        out,
        num_examples=client.num_examples,
        metrics={"loss": float(ins.round) / (1 + len(client.name))},
    )


def run_round(
    strategy: Strategy, server_round: int, live: Sequence[ClientInfo], *, drop: int = 0
) -> dict[str, float]:
    """One round: configure, fake-train every task (the last ``drop`` clients fail), aggregate."""
    pairs = strategy.configure_round(server_round=server_round, clients=live)
    sent = strategy.downlink_state(server_round=server_round)
    results = [fake_fit(client, ins, sent) for client, ins in pairs]
    results = results[: len(results) - drop] if drop else results
    return strategy.aggregate(server_round=server_round, results=results, failures=[])
