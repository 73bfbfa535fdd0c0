"""The small messages: task configs, capabilities, join requests, tasks and peer messages,
between their protobuf form and ``fedgrid.types``. Part of ``fedgrid.proto.serde``'s
conversion layer.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from fedgrid.errors import InvalidUpdateError
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.types import ClientInfo, FitIns, MessageIns, Scalar

__all__ = [
    "config_to_pb",
    "config_from_pb",
    "capabilities_to_pb",
    "client_info_from_join",
    "fit_ins_from_task",
    "message_ins_from_task",
    "envelopes_to_pb",
    "outbox_from_pb",
]


def config_to_pb(config: Mapping[str, Scalar]) -> dict[str, pb.Scalar]:
    out: dict[str, pb.Scalar] = {}
    for key, value in config.items():
        if isinstance(value, bool):
            out[key] = pb.Scalar(b=value)
        elif isinstance(value, int):
            out[key] = pb.Scalar(i=value)
        elif isinstance(value, float):
            out[key] = pb.Scalar(f=value)
        elif isinstance(value, str):
            out[key] = pb.Scalar(s=value)
        else:
            raise TypeError(f"task config '{key}': {type(value).__name__} is not a scalar")
    return out


def config_from_pb(config: Mapping[str, pb.Scalar]) -> dict[str, Scalar]:
    out: dict[str, Scalar] = {}
    for key, value in config.items():
        kind = value.WhichOneof("value")
        out[key] = getattr(value, kind) if kind else None  # type: ignore[assignment]
    return out


def capabilities_to_pb(info: ClientInfo) -> pb.Capabilities:
    return pb.Capabilities(
        device=info.device,
        num_accelerators=info.num_accelerators,
        memory_bytes=info.memory_bytes,
        codecs=list(info.codecs),
    )


def client_info_from_join(client_id: str, request: pb.JoinRequest) -> ClientInfo:
    caps = request.capabilities
    return ClientInfo(
        client_id=client_id,
        name=request.name,
        region=request.region,
        num_examples=request.num_examples,
        device=caps.device or "cpu",
        num_accelerators=caps.num_accelerators,
        memory_bytes=caps.memory_bytes,
        codecs=tuple(caps.codecs) or ("none",),
        lora_rank=request.lora_rank,
    )


def fit_ins_from_task(task: pb.Task) -> FitIns:
    return FitIns(round=task.round, config=config_from_pb(task.config))


def message_ins_from_task(task: pb.Task, client_id: str) -> MessageIns:
    """The ``MessageIns`` of a ``MESSAGE`` task polled by ``client_id``."""
    return MessageIns(
        round=task.round,
        phase=task.phase,
        client_id=client_id,
        peers=tuple(task.peers),
        config=config_from_pb(task.config),
    )


def envelopes_to_pb(messages: Iterable[tuple[str, bytes]]) -> list[pb.Envelope]:
    return [pb.Envelope(peer=peer, payload=payload) for peer, payload in messages]


def outbox_from_pb(envelopes: Iterable[pb.Envelope]) -> dict[str, bytes]:
    """Recipient -> payload of a ``SendMessagesRequest``.

    Raises:
        InvalidUpdateError: two messages to one recipient.
    """
    out: dict[str, bytes] = {}
    for envelope in envelopes:
        if envelope.peer in out:
            raise InvalidUpdateError(f"two messages to recipient {envelope.peer[:64]!r}")
        out[envelope.peer] = envelope.payload
    return out
