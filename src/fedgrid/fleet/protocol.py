"""The per-client round protocol: what a round asks of one client and how its answer is taken.

Both fleets call this module and differ only in transport: ``RemoteFleet`` over gRPC
(``server/phases.py`` sends the tasks, ``server/downloads.py`` the models,
``server/uploads.py`` receives the updates) and the simulated ``InProcessFleet``
(``simulation/fleet.py``, ``simulation/upload.py``) in process. A simulated run therefore
asks what a deployment asks, refuses what it refuses with the same error and message, keeps
an update in the same form and counts the same bytes:

- the task's configuration: ``fit_task`` puts the client's uplink codec (``CodecPolicy``) and
  its error feedback into its task;
- the download's form: ``download_names``, the tensors a client downloads;
- acceptance: ``check_joining`` at Join; ``check_header`` before any tensor of an update is
  read: the ``delta`` flag must match the task's uplink codec (a lossless codec never sends
  differences: a ``delta`` update on a ``none`` task would be added to the global model), and
  ``num_examples`` must be within its bounds (``fleet/bounds.py``; a fit update claims at
  least one example, since its claim is its weight in a mean); then ``UpdateCheck`` on each
  tensor as it completes (shape and dtype are the decoder's, ``serde.ModelAssembler``, against
  the task's expected specs): finite and within the norm bound;
- the update's form: ``update_check`` decides it, in one place: a difference stays a
  difference (``FitRes.delta``) from the client's fit to the strategy's aggregate; it is
  added back only where the client took it against another model than the round's (a lossy
  downlink's shadow, or the model at the client's own LoRA rank);
- a message phase's messages: ``check_outbox`` on what a client sends, ``relay`` to the inboxes;
- the byte tally: ``RoundTally``, the round's wire, payload and uncompressed bytes, up and
  down, by region.

Each refusal raises ``InvalidUpdateError``; the gRPC servicer maps it to INVALID_ARGUMENT
and the simulated fleet records it as the client's ``Failure`` for the round.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from fedgrid.capabilities import check_capabilities
from fedgrid.compression.feedback import is_delta_tensor
from fedgrid.compression.spec import CodecSpec
from fedgrid.constants import MAX_OUTBOX_BYTES, MAX_PHASE_MESSAGE_BYTES
from fedgrid.errors import InvalidUpdateError, PayloadTooLargeError
from fedgrid.fleet.bounds import UpdateBounds
from fedgrid.proto import serde
from fedgrid.textsafe import MAX_LABEL_CHARS, MAX_NAME_CHARS, MAX_REGION_CHARS, check_label
from fedgrid.types import TO_ALL, TO_SERVER, ClientInfo, FitIns, FitRes, MessageIns, ModelState, TensorSpec

if TYPE_CHECKING:
    from fedgrid.fleet.codec_policy import CodecPolicy
    from fedgrid.fleet.downlink import RoundDownlink

__all__ = [
    "MAX_CODECS",
    "RoundTally",
    "UpdateCheck",
    "check_claim",
    "check_delta",
    "check_header",
    "check_joining",
    "check_outbox",
    "download_names",
    "fit_task",
    "raw_bytes",
    "relay",
    "sends_differences",
    "update_check",
    "without_offset",
]

#: Codec names a client may advertise at Join.
MAX_CODECS = 32


def check_joining(joining: ClientInfo, bounds: UpdateBounds) -> None:
    """What a Join must pass (``server/membership.py``'s docstring): its labels, capabilities,
    advertised codecs and ``num_examples``.

    Raises:
        InvalidUpdateError: naming the rule the Join breaks.
    """
    check_label(joining.name, what="name", limit=MAX_NAME_CHARS)
    check_label(joining.region, what="region", limit=MAX_REGION_CHARS)
    check_capabilities(joining.device, joining.num_accelerators, joining.memory_bytes)
    if len(joining.codecs) > MAX_CODECS:
        raise InvalidUpdateError(f"codecs: {len(joining.codecs)} advertised, at most {MAX_CODECS}")
    for codec in joining.codecs:
        check_label(codec, what="codec name", limit=MAX_LABEL_CHARS)
    bounds.check_join(joining.num_examples)


def fit_task(policy: "CodecPolicy", client: ClientInfo, ins: FitIns) -> tuple[FitIns, CodecSpec]:
    """``client``'s fit task as it is sent, and its uplink codec: the policy's codec for the
    client, and its error feedback, in the task's config (a client reads them back from it)."""
    codec = policy.uplink(client)
    return dataclasses.replace(ins, config={**ins.config, **policy.task_config(codec)}), codec


def download_names(ins: FitIns, *, lossless_downlink: bool, codec: CodecSpec) -> frozenset[str] | None:
    """The tensors a client with fit task ``ins`` and uplink ``codec`` downloads (``None``: all):
    ``FitIns.download`` on a lossless downlink, with the tensors it uploads when its uplink
    sends differences (they are taken against their global values)."""
    return ins.download_names(lossless_downlink=lossless_downlink, delta_uplink=sends_differences(codec))


def sends_differences(codec: CodecSpec) -> bool:
    """Whether uplink codec ``codec`` sends differences to the global model (every lossy one does)."""
    return not codec.lossless


def check_delta(codec: CodecSpec, delta: bool) -> None:
    """A fit update carries differences exactly when its task's uplink codec sends them.

    Raises:
        InvalidUpdateError: naming the flag and the codec.
    """
    differences = sends_differences(codec)
    if delta != differences:
        raise InvalidUpdateError(
            f"delta: the upload says delta={delta}, the task's uplink codec {codec.text!r} sends "
            + ("differences (delta=True)" if differences else "whole values (delta=False)")
        )


def check_claim(
    bounds: UpdateBounds, client: ClientInfo, num_examples: int, *, evaluate: bool = False
) -> None:
    """The ``num_examples`` a result claims: within ``bounds`` and, for a fit update, at least 1.

    An evaluation of no examples is not refused here: it fails the client's round when it is
    counted (it says nothing about the model).

    Raises:
        InvalidUpdateError: naming the numbers.
    """
    bounds.check_claim(num_examples, joined=client.num_examples, evaluate=evaluate)
    if not evaluate and num_examples < 1:
        raise InvalidUpdateError("num_examples must be at least 1")


def check_header(
    bounds: UpdateBounds, client: ClientInfo, *, num_examples: int, delta: bool, codec: CodecSpec
) -> None:
    """Everything a fit update's header must pass before its tensors are read
    (``check_delta``, then ``check_claim``)."""
    check_delta(codec, delta)
    check_claim(bounds, client, num_examples)


def raw_bytes(expected: Mapping[str, TensorSpec]) -> int:
    """What an update of the specs ``expected`` weighs uncompressed."""
    return sum(spec.nbytes for spec in expected.values())


class UpdateCheck:
    """Checks one fit update tensor by tensor, as each completes.

    Args:
        base: the round's model the client started from (what differences apply to).
        bounds: the norm bound the update must meet.
        delta: the update's floating tensors are differences from ``base``.
        keep_delta: keep differences as differences (``FitRes.delta``). Otherwise they are
            added to ``base`` and the update kept as values.
        offset: added to each kept difference that it names (``RoundDownlink.offset``: from
            the shadow the client held to the round's model), in its work dtype.
    """

    def __init__(
        self,
        base: Mapping[str, torch.Tensor],
        bounds: UpdateBounds,
        *,
        delta: bool,
        keep_delta: bool = False,
        offset: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.base, self.delta, self.offset = base, delta, offset
        self.keeps_delta = delta and keep_delta
        #: Its kept differences carry ``offset`` (they are from the round's model, not ``base``).
        self.shifts = self.keeps_delta and offset is not None
        self.norm = bounds.norm(base)  # accumulates over the tensors: a resumed upload goes on counting

    def add(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Tensor ``name`` as received; returns the value to keep (``keeps_delta``: a difference).

        Raises:
            InvalidUpdateError: the value (or the difference kept) is not finite, or the norm
                so far is over its bound.
        """
        # A tensor the round's model lacks (SCAFFOLD's control deltas) comes as it is (client/uplink.py).
        difference = self.delta and is_delta_tensor(tensor) and name in self.base
        if difference and self.keeps_delta:  # no pass over the model
            shift = None if self.offset is None else self.offset.get(name)
            value = tensor if shift is None else (tensor.to(shift.dtype) + shift).to(tensor.dtype)
        else:
            value = self.base[name] + tensor if difference else tensor
            difference = False
        serde.check_finite({name: value})
        if self.norm is not None:  # a difference: the client's own change, from the model it held
            self.norm.add(name, tensor if difference else value, difference=difference)
        return value

    def whole(self, received: Mapping[str, torch.Tensor]) -> ModelState:
        """``add`` on every tensor of ``received``, in order."""
        return OrderedDict((name, self.add(name, tensor)) for name, tensor in received.items())


def update_check(
    downlink: "RoundDownlink",
    bounds: UpdateBounds,
    *,
    delta: bool,
    ranked: Mapping[str, torch.Tensor] | None = None,
    late: bool = False,
) -> "UpdateCheck":
    """The check of one fit update, and the form it is kept in (the one place that decides it).

    A difference stays a difference (``FitRes.delta``) from the client's fit to the strategy:
    one from the round's model. A client on a lossy downlink took it against the shadow it
    holds (``downlink.base``): the shadow's ``offset`` from the round's model is added to it,
    a difference still; but for a ``late`` update (its task carried past its round's quorum),
    which is merged as its client's own change (``aggregation.staleness.rebase``). A client of
    its own LoRA rank (``ranked``: the round's model at that rank, of other shapes, on a
    lossless downlink) keeps its difference from that model: the ``svd`` merge takes its
    product from the difference and the model at its rank (``aggregation.lora.svd_average``).
    """
    offset = None if late or ranked is not None else downlink.offset
    base = downlink.base if ranked is None else ranked
    return UpdateCheck(base, bounds, delta=delta, keep_delta=True, offset=offset)


def check_outbox(
    ins: MessageIns,
    messages: Mapping[str, bytes],
    *,
    max_message: int = MAX_PHASE_MESSAGE_BYTES,
    max_total: int = MAX_OUTBOX_BYTES,
) -> "OrderedDict[str, bytes]":
    """Checks what a client sends in a message phase; returns it in a canonical order.

    Recipients are peers of the phase other than the sender, ``TO_ALL`` (every other peer;
    not with peers named too) or ``TO_SERVER``.

    Raises:
        InvalidUpdateError: an unknown recipient, the sender itself, ``TO_ALL`` next to named
            peers, or a payload that is not bytes.
        PayloadTooLargeError: a message over ``max_message`` bytes, or all over ``max_total``.
    """
    peers = set(ins.peers)
    total = 0
    for recipient, payload in messages.items():
        if not isinstance(payload, (bytes, bytearray)):
            raise InvalidUpdateError(
                f"phase {ins.phase!r}: message to {recipient!r} is {type(payload).__name__}, not bytes"
            )
        if recipient in (TO_ALL, TO_SERVER):
            pass
        elif recipient == ins.client_id:
            raise InvalidUpdateError(f"phase {ins.phase!r}: a client cannot address itself")
        elif recipient not in peers:
            raise InvalidUpdateError(
                f"phase {ins.phase!r}: recipient {recipient[:64]!r} is not a peer of this phase"
            )
        if len(payload) > max_message:
            raise PayloadTooLargeError(
                f"phase {ins.phase!r}: message to {recipient[:64]!r} is {len(payload)} bytes, at most {max_message}"
            )
        total += len(payload)
    if TO_ALL in messages and any(r not in (TO_ALL, TO_SERVER) for r in messages):
        raise InvalidUpdateError(
            f"phase {ins.phase!r}: a message to every peer ({TO_ALL!r}) excludes messages to named peers"
        )
    if total > max_total:
        raise PayloadTooLargeError(f"phase {ins.phase!r}: {total} bytes of messages, at most {max_total}")
    order = {peer: i for i, peer in enumerate(ins.peers)}
    return OrderedDict(
        sorted(((r, bytes(p)) for r, p in messages.items()), key=lambda kv: (order.get(kv[0], -1), kv[0]))
    )


def relay(
    peer_order: Sequence[str], sent: Mapping[str, Mapping[str, bytes]]
) -> dict[str, "OrderedDict[str, bytes]"]:
    """The inbox of every client that sent (``sent``: sender -> recipient -> payload): the
    messages addressed to it, directly or to all, by sender in ``peer_order``. Messages to
    the server or to clients that sent nothing (failed) are not relayed to anyone."""
    inboxes: dict[str, OrderedDict[str, bytes]] = {cid: OrderedDict() for cid in peer_order if cid in sent}
    for sender in peer_order:
        messages = sent.get(sender)
        if messages is None:
            continue
        for recipient, payload in messages.items():
            if recipient == TO_ALL:
                for cid, inbox in inboxes.items():
                    if cid != sender:
                        inbox[sender] = payload
            elif recipient != TO_SERVER and recipient in inboxes:
                inboxes[recipient][sender] = payload
    return inboxes


def without_offset(result: FitRes, offset: Mapping[str, torch.Tensor]) -> FitRes:
    """A delta result kept with a downlink's ``offset`` (``update_check``), as its client's own
    change again: for an upload begun on time that landed after its round's quorum (late)."""
    state: ModelState = OrderedDict()
    for name, value in result.state.items():
        shift = offset.get(name)
        state[name] = value if shift is None else (value.to(shift.dtype) - shift).to(value.dtype)
    return dataclasses.replace(result, state=state)


@dataclass
class RoundTally:
    """The bytes of one round's phase: wire bytes up and down, by client region too, and what
    the accepted updates weigh as sent (``payload_up``) and uncompressed (``raw_up``)."""

    bytes_up: int = 0
    bytes_down: int = 0
    region_bytes: dict[str, list[int]] = field(default_factory=dict)  # [up, down] by region (labelled ones)
    raw_up: int = 0
    payload_up: int = 0

    def add_up(self, region: str, *, wire: int, payload: int = 0, raw: int = 0) -> None:
        """An accepted upload of ``wire`` bytes on the wire."""
        self.bytes_up += wire
        if region:
            self.region_bytes.setdefault(region, [0, 0])[0] += wire
        self.payload_up += payload
        self.raw_up += raw

    def add_down(self, region: str, wire: int) -> None:
        """A download of ``wire`` bytes on the wire."""
        self.bytes_down += wire
        if region:
            self.region_bytes.setdefault(region, [0, 0])[1] += wire

    def extra(self) -> dict[str, float]:
        """``RoundOutcome.extra``'s byte entries: ``uplink_ratio`` (when anything was accepted)
        and ``bytes_up.REGION`` / ``bytes_down.REGION``, regions in sorted order."""
        extra = {"uplink_ratio": self.raw_up / self.payload_up} if self.payload_up else {}
        for region, (up, down) in sorted(self.region_bytes.items()):
            extra[f"bytes_up.{region}"], extra[f"bytes_down.{region}"] = float(up), float(down)
        return extra
