"""The chunk stream's framing: dtype codes, the stream header, and ``Chunk`` frames read and
written without protobuf objects for the bulk data.

A model travels as a stream of ``Chunk`` messages: the first carries a ``StreamHeader``; a
chunk that carries a ``TensorMeta`` starts a tensor; ``data`` carries up to ``chunk_size``
bytes of the current tensor's payload. Part of ``fedgrid.proto.serde``'s conversion layer.

On gRPC, frames smaller than the chunk size travel several to a message (``batched``, read
back by ``unbatched``): a model of many small tensors (a tiny Llama: 21 tensors, 150 kB) went as
21 messages each way, each a hop between the threads of both ends (gRPC's, the event loop's, the
reader's): most of a sync's round trip. A batch starts with the byte 0, which no ``Chunk`` starts
with (field 0 does not exist), then each frame behind its length (a varint); a message that does
not start with 0 is one frame, so a stream of single frames reads as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, TypeVar

import torch
import xxhash
from google.protobuf.message import DecodeError, Message

from fedgrid.errors import InvalidUpdateError
from fedgrid.proto import fedgrid_pb2 as pb

__all__ = [
    "DTYPE_TO_PB",
    "PB_TO_DTYPE",
    "GRPC_FRAME_BYTES",
    "StreamInfo",
    "checksum",
    "wire_size",
    "parse_frame",
    "read_header",
    "stream_info",
    "parse_message",
    "encode_varint",
    "chunk_frame",
    "batched",
    "unbatched",
]

DTYPE_TO_PB: dict[torch.dtype, pb.DType] = {
    torch.float32: pb.FLOAT32,
    torch.float64: pb.FLOAT64,
    torch.float16: pb.FLOAT16,
    torch.bfloat16: pb.BFLOAT16,
    torch.float8_e4m3fn: pb.FLOAT8_E4M3FN,
    torch.float8_e5m2: pb.FLOAT8_E5M2,
    torch.float8_e4m3fnuz: pb.FLOAT8_E4M3FNUZ,
    torch.float8_e5m2fnuz: pb.FLOAT8_E5M2FNUZ,
    torch.int8: pb.INT8,
    torch.int16: pb.INT16,
    torch.int32: pb.INT32,
    torch.int64: pb.INT64,
    torch.uint8: pb.UINT8,
    torch.uint16: pb.UINT16,
    torch.uint32: pb.UINT32,
    torch.uint64: pb.UINT64,
    torch.bool: pb.BOOL,
    torch.complex64: pb.COMPLEX64,
    torch.complex128: pb.COMPLEX128,
}
PB_TO_DTYPE: dict[int, torch.dtype] = {v: k for k, v in DTYPE_TO_PB.items()}

M = TypeVar("M", bound=Message)

#: gRPC's length-prefixed message framing: 1 flag byte + 4 length bytes per message.
GRPC_FRAME_BYTES = 5


def checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of ``data``: about 9 GB/s here, over twice zlib's CRC32, so it costs little."""
    return xxhash.xxh3_64_intdigest(data)


def wire_size(message: pb.Chunk | bytes) -> int:
    """Bytes a message occupies on the wire: its encoding plus gRPC's message framing."""
    size = len(message) if isinstance(message, (bytes, bytearray, memoryview)) else message.ByteSize()
    return size + GRPC_FRAME_BYTES


@dataclass(frozen=True)
class StreamInfo:
    """The header of a chunk stream, as plain Python."""

    run_id: str = ""
    task_id: str = ""
    round: int = 0
    client_id: str = ""
    num_examples: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)
    resume_from_chunk: int = 0
    delta: bool = False
    version: int = 0
    base_version: int = 0


def stream_info(header: pb.StreamHeader) -> StreamInfo:
    """What a stream header says, as a ``StreamInfo``."""
    return StreamInfo(
        run_id=header.run_id,
        task_id=header.task_id,
        round=header.round,
        client_id=header.client_id,
        num_examples=header.num_examples,
        metrics=dict(header.metrics),
        resume_from_chunk=header.resume_from_chunk,
        delta=header.delta,
        version=header.version,
        base_version=header.base_version,
    )


def parse_message(kind: type[M], data: memoryview, what: str) -> M:
    """``data`` decoded as a ``kind`` message.

    Raises:
        InvalidUpdateError: it does not decode (the message names ``what``).
    """
    try:
        return kind.FromString(data.tobytes())
    except DecodeError:
        raise InvalidUpdateError(f"malformed chunk: cannot decode the {what}") from None


# Chunk's fields on the wire: key = field number << 3 | wire type 2 (length-delimited).
_HEADER_KEY, _TENSOR_KEY, _DATA_KEY = b"\x0a", b"\x12", b"\x1a"


def encode_varint(value: int) -> bytes:
    """``value`` (not negative) as a protobuf varint."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def chunk_frame(header: bytes | None, meta: bytes | None, data: memoryview) -> bytes:
    """A serialized ``Chunk`` with the given header, tensor meta and data (each left out when absent)."""
    parts: list[bytes | memoryview] = []
    if header is not None:
        parts += [_HEADER_KEY, encode_varint(len(header)), header]
    if meta is not None:
        parts += [_TENSOR_KEY, encode_varint(len(meta)), meta]
    if len(data):
        parts += [_DATA_KEY, encode_varint(len(data)), data]
    return b"".join(parts)


#: The first byte of a message of several frames (``batched``).
BATCH = b"\x00"


def batched(frames: Iterable[bytes], limit: int) -> Iterator[bytes]:
    """``frames`` as gRPC messages of at most ``limit`` bytes: a frame that leaves no room for
    another goes alone, as it is; smaller consecutive ones go together, behind ``BATCH``, each
    after its length. A batch of one frame is that frame."""
    parts: list[tuple[bytes, bytes]] = []  # (length, frame)
    size = 1

    def flush() -> bytes:
        message = parts[0][1] if len(parts) == 1 else BATCH + b"".join(n + f for n, f in parts)
        parts.clear()
        return message

    for frame in frames:
        length = encode_varint(len(frame))
        if parts and size + len(length) + len(frame) > limit:
            yield flush()
            size = 1
        if 1 + len(length) + len(frame) > limit:  # no room for another: alone
            yield frame
            continue
        parts.append((length, frame))
        size += len(length) + len(frame)
    if parts:
        yield flush()


def unbatched(messages: Iterable[bytes]) -> Iterator[bytes]:
    """The frames of ``messages`` (``batched``'s): a batch's frames in order, any other message as it is.

    Raises:
        InvalidUpdateError: a batch whose lengths run past its end.
    """
    for message in messages:
        if message[:1] != BATCH:
            yield message
            continue
        buf = memoryview(message)
        pos = 1
        while pos < len(buf):
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise InvalidUpdateError("malformed message: a frame runs past the end of its batch")
            yield bytes(buf[pos : pos + length])
            pos += length


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise InvalidUpdateError("malformed chunk: bad varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def parse_frame(frame: bytes | memoryview) -> tuple[memoryview | None, memoryview | None, memoryview | None]:
    """Splits an encoded ``Chunk`` into its header, tensor and data fields, without copying.

    Raises:
        InvalidUpdateError: not a well-formed ``Chunk`` encoding.
    """
    buf = memoryview(frame).cast("B")
    fields: list[memoryview | None] = [None, None, None]
    pos, n = 0, len(buf)
    while pos < n:
        key, pos = _read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 2:
            length, pos = _read_varint(buf, pos)
            if pos + length > n:
                raise InvalidUpdateError("malformed chunk: a field runs past the end of the message")
            value, pos = buf[pos : pos + length], pos + length
        elif wire_type == 0:
            _, pos = _read_varint(buf, pos)
            value = None
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
            value = None
        else:
            raise InvalidUpdateError(f"malformed chunk: wire type {wire_type}")
        if 1 <= number <= 3:
            if value is None:
                raise InvalidUpdateError(f"malformed chunk: field {number} has the wrong wire type")
            if fields[number - 1] is not None:
                raise InvalidUpdateError(f"malformed chunk: field {number} repeated in one message")
            fields[number - 1] = value
    if pos != n:
        raise InvalidUpdateError("malformed chunk: truncated field")
    return fields[0], fields[1], fields[2]


def read_header(frame: bytes | memoryview) -> StreamInfo:
    """The ``StreamHeader`` of a stream's first message.

    Raises:
        InvalidUpdateError: the message is malformed or carries no header.
    """
    header, _, _ = parse_frame(frame)
    if header is None:
        raise InvalidUpdateError("stream does not start with a header")
    return stream_info(parse_message(pb.StreamHeader, header, "stream header"))
