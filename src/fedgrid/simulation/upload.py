"""Phase 3 of ``InProcessFleet``'s round: a simulated client's update on its way up.

The update goes through its uplink codec (error feedback per client), is framed, decoded and
accepted by the coordinator's own functions (``fleet/protocol.py``: the header's ``delta``
flag and ``num_examples``, then each tensor finite and within the norm bound, then the
round's bytes), so a simulated client fails exactly where a deployed one would, with the
same message. A raw (``none``) upload that would decode to exactly what was sent skips the
encoding, framing and decoding (``raw_passes``); its bytes are counted arithmetically
(``serde.stream_wire_bytes``), equal to the frames'.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Mapping

import torch

from fedgrid.client.api import FitOutput, OwnedState
from fedgrid.client.uplink import UplinkEncoder
from fedgrid.compression.spec import CodecSpec
from fedgrid.fleet import protocol
from fedgrid.fleet.bounds import UpdateBounds
from fedgrid.fleet.downlink import RoundDownlink
from fedgrid.fleet.protocol import RoundTally
from fedgrid.proto import serde
from fedgrid.types import ClientInfo, FitIns, FitRes, ModelState, TensorSpec

__all__ = ["raw_passes", "upload"]


def raw_passes(out: FitOutput, expected: Mapping[str, TensorSpec]) -> bool:
    """Whether a raw (codec ``none``) upload of ``out`` would decode to exactly ``out``: then
    ``upload`` skips encoding, framing and decoding it (a lossless fast path; the wire
    bytes are counted by ``serde.stream_wire_bytes``, equal to the frames'). Anything the wire
    would refuse or change (specs other than the task's, a dtype it cannot carry, metrics or
    an example count that protobuf cannot hold as sent) takes the wire's own path, so its
    failure reads exactly as in deployment."""
    if TensorSpec.of(out.state) != dict(expected) or any(
        t.dtype not in serde.DTYPE_TO_PB for t in out.state.values()
    ):
        return False
    if type(out.num_examples) is not int or not 0 <= out.num_examples < 2**64:
        return False
    return all(type(k) is str and type(v) in (int, float) for k, v in out.metrics.items())


def upload(
    *,
    server_round: int,
    info: ClientInfo,
    ins: FitIns,
    codec: CodecSpec,
    state: ModelState,
    out: FitOutput,
    downlink: RoundDownlink,
    ranked: ModelState | None,
    round_specs: Mapping[str, TensorSpec],
    tally: RoundTally,
    bounds: UpdateBounds,
    chunk_size: int,
    fast: bool,
    uplink: Callable[[], UplinkEncoder],
) -> FitRes:
    """One client's update through its uplink codec, accepted as the coordinator accepts it
    (``fleet/protocol.py``: header, then each tensor, then the bytes), its bytes added to ``tally``.

    Args:
        state: the model the client downloaded (what a difference is taken against).
        out: what the client's training returned.
        downlink: the round's downloads (``downlink.base``: the model the clients hold).
        ranked: for a client of its own LoRA rank, the round's model at that rank.
        round_specs: the round's tensors, unless the task names its own (``FitIns.expected``).
        fast: take the raw fast path where ``raw_passes``.
        uplink: the client's uplink encoder for ``codec`` (called on the wire's path only).

    Raises:
        InvalidUpdateError: whatever the coordinator would refuse, with its message.
    """
    expected = ins.expected or round_specs
    if fast and codec == CodecSpec.NONE and raw_passes(out, expected):  # the wire's result, without the wire
        header, received, wire, payload = _raw(server_round, info, out, bounds=bounds, chunk_size=chunk_size)
    else:
        header, received, wire, payload = _wire(
            server_round,
            info,
            codec,
            state,
            out,
            expected,
            bounds=bounds,
            chunk_size=chunk_size,
            uplink=uplink,
        )
    # Kept in the form RemoteFleet keeps it (``protocol.update_check``).
    check = protocol.update_check(downlink, bounds, delta=header.delta, ranked=ranked)
    update = check.whole(received)
    tally.add_up(info.region, wire=wire, payload=payload, raw=protocol.raw_bytes(expected))
    return FitRes(info, update, header.num_examples, header.metrics, check.keeps_delta)


def _raw(
    server_round: int, info: ClientInfo, out: FitOutput, *, bounds: UpdateBounds, chunk_size: int
) -> tuple[serde.StreamInfo, ModelState, int, int]:
    """The fast path: the header and tensors the wire would deliver, its bytes and the payload's."""
    metrics = {k: float(v) for k, v in out.metrics.items()}
    header = serde.StreamInfo(round=server_round, num_examples=out.num_examples, metrics=metrics)
    serde.check_metrics(header.metrics)
    protocol.check_header(bounds, info, num_examples=header.num_examples, delta=False, codec=CodecSpec.NONE)
    # A TorchClient's upload and the batched engine's rows are fresh copies (OwnedState);
    # anything else a client may still hold.
    received = (
        OrderedDict(out.state)
        if isinstance(out.state, OwnedState)
        else OrderedDict(
            (n, t.detach().to("cpu").clone(memory_format=torch.contiguous_format))
            for n, t in out.state.items()
        )
    )
    wire = serde.stream_wire_bytes(received, header, chunk_size=chunk_size)
    payload = sum(t.numel() * t.element_size() for t in received.values())
    return header, received, wire, payload


def _wire(
    server_round: int,
    info: ClientInfo,
    codec: CodecSpec,
    state: ModelState,
    out: FitOutput,
    expected: Mapping[str, TensorSpec],
    *,
    bounds: UpdateBounds,
    chunk_size: int,
    uplink: Callable[[], UplinkEncoder],
) -> tuple[serde.StreamInfo, ModelState, int, int]:
    """The wire's path: encoded, framed, its header checked, decoded; its bytes and the payload's."""
    encoded, delta = uplink().encode(global_state=state, new_state=out.state)
    head = serde.StreamInfo(
        round=server_round, num_examples=out.num_examples, metrics=out.metrics, delta=delta
    )
    frames = list(encoded.frames(head, chunk_size=chunk_size))
    sent = serde.read_header(frames[0])
    protocol.check_header(bounds, info, num_examples=sent.num_examples, delta=sent.delta, codec=codec)
    header, received = serde.decode_chunks(frames, expected=expected, codec=codec)
    return header, received, sum(serde.wire_size(c) for c in frames), encoded.total_bytes
