"""The simulated fleet's rounds that train nothing: each client's evaluation of the global
model, and the message phases (each client's ``exchange``, the relay, each sender's
``receive``), checked as the coordinator checks them. ``InProcessFleet.evaluate_round`` and
``InProcessFleet.message_round`` run them on the fleet's clients.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Mapping, Sequence

from fedgrid.aggregation.lora_ranks import RankViews
from fedgrid.client.api import Client
from fedgrid.fleet import protocol
from fedgrid.fleet.base import RoundOutcome
from fedgrid.fleet.bounds import UpdateBounds
from fedgrid.fleet.protocol import check_outbox, relay
from fedgrid.proto import serde
from fedgrid.types import (
    ClientInfo,
    EvaluateIns,
    EvaluateRes,
    Failure,
    MessageIns,
    MessageRes,
    ModelState,
)

__all__ = ["evaluate_clients", "exchange_messages"]

# The fleet's logger: a client's failed receive is logged under the name it always had.
log = logging.getLogger("fedgrid.simulation.fleet")


def evaluate_clients(
    clients: Mapping[str, Client],
    global_state: ModelState,
    assignments: Sequence[tuple[ClientInfo, EvaluateIns]],
    *,
    server_round: int,
    chunk_size: int,
    bounds: UpdateBounds,
) -> RoundOutcome[EvaluateRes]:
    """Each assigned client's ``evaluate`` of ``global_state``, which it downloads over the
    simulated wire; its result crosses the wire back and is checked against ``bounds``
    (``protocol.check_claim``) as the coordinator checks it. A client that fails, or evaluated
    no examples, is a ``Failure``."""
    views = RankViews(global_state)  # a client of its own LoRA rank evaluates the model at that rank
    encoded = {0: serde.EncodedModel(global_state)}
    results: list[EvaluateRes] = []
    failures: list[Failure] = []
    bytes_up = bytes_down = 0
    for info, ins in assignments:
        rank = info.lora_rank if views.differs(info.lora_rank) else 0
        if rank not in encoded:
            encoded[rank] = serde.EncodedModel(views.at(rank))
        down = list(encoded[rank].frames(serde.StreamInfo(round=server_round), chunk_size=chunk_size))
        bytes_down += sum(serde.wire_size(c) for c in down)
        _, state = serde.decode_chunks(down)
        try:
            out = clients[info.client_id].evaluate(state, ins.config)
            info_up = serde.StreamInfo(round=server_round, num_examples=out.num_examples, metrics=out.metrics)
            up = list(serde.EncodedModel({}).frames(info_up))
            header, _ = serde.decode_chunks(up, expected={})
            protocol.check_claim(bounds, info, header.num_examples, evaluate=True)
        except Exception as exc:  # a client's failure is data for the strategy
            failures.append(Failure(info, f"{type(exc).__name__}: {exc}"))
            continue
        bytes_up += sum(serde.wire_size(c) for c in up)
        if header.num_examples < 1:
            failures.append(Failure(info, "evaluated no examples"))
            continue
        results.append(EvaluateRes(info, header.num_examples, header.metrics))
    return RoundOutcome(results, failures, bytes_up=bytes_up, bytes_down=bytes_down)


def exchange_messages(
    clients: Mapping[str, Client],
    assignments: Sequence[tuple[ClientInfo, MessageIns]],
    *,
    server_round: int,
    phase: str,
    available: Callable[[str], bool],
) -> RoundOutcome[MessageRes]:
    """Each assigned client's ``exchange`` in turn (a client for which ``available`` is false
    fails without one), checked as the coordinator checks it (``protocol.check_outbox``), then
    the relay (``protocol.relay``) and each sender's ``receive``: the messages and bytes of a
    deployment's phase ``phase``."""
    results: list[MessageRes] = []
    failures: list[Failure] = []
    sent: dict[str, dict[str, bytes]] = {}
    tasks: dict[str, MessageIns] = {}
    for info, ins in assignments:
        ins = dataclasses.replace(ins, client_id=info.client_id)
        if not available(info.client_id):
            failures.append(Failure(info, f"unavailable in round {server_round} (simulated)"))
            continue
        try:
            checked = check_outbox(ins, clients[info.client_id].exchange(ins))
        except Exception as exc:  # a client's failure is data for the strategy
            failures.append(Failure(info, f"{type(exc).__name__}: {exc}"))
            continue
        sent[info.client_id], tasks[info.client_id] = checked, ins
        results.append(MessageRes(info, checked))
    inboxes = relay([info.client_id for info, _ in assignments], sent)
    bytes_down = 0
    for cid, inbox in inboxes.items():
        bytes_down += sum(len(p) for p in inbox.values())
        try:
            clients[cid].receive(tasks[cid], inbox)
        except Exception as exc:  # as a deployed client does: logged, its next task will tell
            log.warning("client %s: receiving phase %s failed: %s", cid, phase, exc)
    bytes_up = sum(len(p) for messages in sent.values() for p in messages.values())
    return RoundOutcome(results, failures, bytes_up=bytes_up, bytes_down=bytes_down)
