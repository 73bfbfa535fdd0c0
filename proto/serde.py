"""The one conversion module between protobuf messages and Python/torch objects.

Protobuf types stay here and in the two gRPC runtime modules (``server/service.py`` and
``client/runtime.py``); everything else sees dataclasses and tensors.

A model travels as a stream of ``Chunk`` messages: the first carries a ``StreamHeader``; a
chunk that carries a ``TensorMeta`` starts a tensor; ``data`` carries up to ``chunk_size``
bytes of the current tensor's payload. ``ModelAssembler`` rebuilds the tensors and checks
every claim a stream makes before it allocates or keeps anything.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, TypeVar

import numpy as np
import torch
import xxhash
from google.protobuf.message import DecodeError, Message

from fedgrid.compression import get_codec
from fedgrid.constants import CHUNK_SIZE, MAX_TENSOR_BYTES
from fedgrid.errors import InvalidUpdateError, PayloadTooLargeError
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto.buffers import BufferPool, receive_buffers
from fedgrid.textsafe import MAX_LABEL_CHARS, check_label, escape
from fedgrid.types import ClientInfo, FitIns, MessageIns, ModelState, Scalar, TensorSpec

__all__ = [
    "DTYPE_TO_PB",
    "PB_TO_DTYPE",
    "TensorSpec",
    "StreamInfo",
    "EncodedModel",
    "encode_model",
    "ModelAssembler",
    "decode_chunks",
    "check_metrics",
    "stream_wire_bytes",
    "check_finite",
    "checksum",
    "wire_size",
    "parse_frame",
    "read_header",
    "config_to_pb",
    "config_from_pb",
    "capabilities_to_pb",
    "client_info_from_join",
    "fit_ins_from_task",
    "message_ins_from_task",
    "envelopes_to_pb",
    "outbox_from_pb",
]

DTYPE_TO_PB: dict[torch.dtype, int] = {
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

#: Metrics one stream header may carry (each name a label of at most ``MAX_LABEL_CHARS``
#: printable characters: metric names end up in logs and in ``metrics.jsonl``).
MAX_METRICS = 64

#: gRPC's length-prefixed message framing: 1 flag byte + 4 length bytes per message.
GRPC_FRAME_BYTES = 5


def checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of ``data``: about 9 GB/s here, over twice zlib's CRC32, so it costs little."""
    return xxhash.xxh3_64_intdigest(data)


def wire_size(message: pb.Chunk | bytes) -> int:
    """Bytes a message occupies on the wire: its encoding plus gRPC's message framing."""
    size = len(message) if isinstance(message, (bytes, bytearray, memoryview)) else message.ByteSize()
    return size + GRPC_FRAME_BYTES


def check_metrics(metrics: Mapping[str, float]) -> None:
    """A stream's metrics: at most ``MAX_METRICS``, printable names, finite values.

    Raises:
        InvalidUpdateError: naming the rule broken.
    """
    if len(metrics) > MAX_METRICS:
        raise InvalidUpdateError(f"metrics: {len(metrics)} reported, at most {MAX_METRICS}")
    for key, value in metrics.items():
        check_label(key, what="metric name", limit=MAX_LABEL_CHARS)
        if not math.isfinite(value):
            raise InvalidUpdateError(f"metric {escape(key)} is {value}")


def stream_wire_bytes(state: Mapping[str, torch.Tensor], info: StreamInfo, *, chunk_size: int = CHUNK_SIZE) -> int:
    """What ``EncodedModel(state).frames(info, chunk_size=...)`` puts on the wire (``wire_size``
    of each frame, summed), computed without encoding: with the raw codec a payload is the
    tensor's bytes, so only the header and the tensor metas are serialized (to measure them).

    Exact but for one case: a payload whose xxh3 checksum is 0 (a 2**-64 chance) has that
    field omitted by protobuf, 9 bytes fewer than counted here.

    Raises:
        InvalidUpdateError: a dtype that cannot be sent.
        ValueError: ``chunk_size`` is not positive.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    parts: list[tuple[int, int]] = []  # (serialized meta bytes, payload bytes) per tensor
    for name, tensor in state.items():
        if tensor.dtype not in DTYPE_TO_PB:
            raise InvalidUpdateError(f"tensor {escape(name)}: dtype {tensor.dtype} cannot be sent")
        nbytes = tensor.numel() * tensor.element_size()
        meta = pb.TensorMeta(name=name, dtype=DTYPE_TO_PB[tensor.dtype], shape=list(tensor.shape), codec="none", nbytes=nbytes, checksum=1)
        parts.append((meta.ByteSize(), nbytes))
    header = pb.StreamHeader(
        run_id=info.run_id, task_id=info.task_id, round=info.round, num_tensors=len(parts), total_bytes=sum(n for _, n in parts),
        client_id=info.client_id, num_examples=info.num_examples, metrics=dict(info.metrics), delta=info.delta,
        version=info.version, base_version=info.base_version,
    ).ByteSize()

    def field(n: int) -> int:  # key byte, length varint, bytes
        return 1 + len(_varint(n)) + n

    size = field(header)
    frames = 0
    for meta, nbytes in parts:
        size += field(meta)
        full, rest = divmod(nbytes, chunk_size)
        size += full * field(chunk_size) + (field(rest) if rest else 0)
        frames += max(1, full + (1 if rest else 0))
    return size + max(1, frames) * GRPC_FRAME_BYTES


def read_header(frame: bytes | memoryview) -> StreamInfo:
    """The ``StreamHeader`` of a stream's first message.

    Raises:
        InvalidUpdateError: the message is malformed or carries no header.
    """
    header, _, _ = parse_frame(frame)
    if header is None:
        raise InvalidUpdateError("stream does not start with a header")
    return _info(_parse(pb.StreamHeader, header, "stream header"))


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


@dataclass(frozen=True)
class _Encoded:
    meta: pb.TensorMeta
    payload: memoryview


class EncodedModel:
    """A model encoded once, streamed many times (every client of a round downloads the same bytes).

    Args:
        state: named tensors, sent in this order.
        codec: codec id for every tensor.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], *, codec: str = "none") -> None:
        impl = get_codec(codec)
        self._tensors: list[_Encoded] = []
        for name, tensor in state.items():
            if tensor.dtype not in DTYPE_TO_PB:
                raise InvalidUpdateError(f"tensor {escape(name)}: dtype {tensor.dtype} cannot be sent")
            self._add(name, tensor.dtype, tuple(tensor.shape), codec, impl.encode(tensor))
        self.total_bytes = sum(t.meta.nbytes for t in self._tensors)

    @classmethod
    def from_payloads(cls, items: Iterable[tuple[str, torch.dtype, tuple[int, ...], str, bytes]]) -> "EncodedModel":
        """A model already encoded elsewhere (error feedback must send exactly the payloads it
        kept residuals for): ``(name, dtype, shape, codec spec, payload)`` per tensor."""
        self = cls({})
        for name, dtype, shape, codec, payload in items:
            self._add(name, dtype, shape, codec, payload)
        self.total_bytes = sum(t.meta.nbytes for t in self._tensors)
        return self

    def _add(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], codec: str, payload: bytes | memoryview) -> None:
        view = memoryview(payload).cast("B")
        meta = pb.TensorMeta(
            name=name, dtype=DTYPE_TO_PB[dtype], shape=list(shape), codec=codec, nbytes=len(view), checksum=checksum(view)
        )
        self._tensors.append(_Encoded(meta, view))

    def __len__(self) -> int:
        return len(self._tensors)

    def payloads(self) -> list[tuple[str, int, bytes]]:
        """``(name, checksum, payload)`` of each tensor as it goes on the wire, in order."""
        return [(t.meta.name, t.meta.checksum, bytes(t.payload)) for t in self._tensors]

    def frames(self, info: StreamInfo, *, chunk_size: int = CHUNK_SIZE, start: int = 0) -> Iterator[bytes]:
        """Yields the stream as encoded ``Chunk`` messages: the header on the first, then each
        tensor's meta and payload.

        Frames are built from pre-encoded parts plus one copy of each payload slice, so the
        bulk data never passes through protobuf objects; each frame parses as a ``Chunk``.
        With ``start > 0`` (resuming a broken upload) the stream is a header-only message
        with ``resume_from_chunk = start`` followed by frames ``start, start + 1, ...``;
        nothing before ``start`` is built.
        """
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        header = pb.StreamHeader(
            run_id=info.run_id,
            task_id=info.task_id,
            round=info.round,
            num_tensors=len(self._tensors),
            total_bytes=self.total_bytes,
            client_id=info.client_id,
            num_examples=info.num_examples,
            metrics=dict(info.metrics),
            resume_from_chunk=start,
            delta=info.delta,
            version=info.version,
            base_version=info.base_version,
        ).SerializeToString()
        pending_header: bytes | None = header
        if start > 0:
            yield _frame(header, None, memoryview(b""))
            pending_header = None
        index = 0
        for enc in self._tensors:
            meta: bytes | None = enc.meta.SerializeToString()
            n = len(enc.payload)
            for offset in range(0, max(n, 1), chunk_size):
                if index >= start:
                    yield _frame(pending_header, meta, enc.payload[offset : offset + chunk_size])
                    pending_header = None
                meta = None
                index += 1
        if pending_header is not None:  # a model with no tensors is just its header
            yield _frame(pending_header, None, memoryview(b""))

    def num_frames(self, *, chunk_size: int = CHUNK_SIZE) -> int:
        """Messages in a full stream (at least 1)."""
        return max(1, sum(max(1, -(-len(t.payload) // chunk_size)) for t in self._tensors))

    def chunks(self, info: StreamInfo, *, chunk_size: int = CHUNK_SIZE) -> Iterator[pb.Chunk]:
        """The same stream as ``frames``, as message objects (for tests and tools)."""
        for frame in self.frames(info, chunk_size=chunk_size):
            yield pb.Chunk.FromString(frame)


# Chunk's fields on the wire: key = field number << 3 | wire type 2 (length-delimited).
_HEADER_KEY, _TENSOR_KEY, _DATA_KEY = b"\x0a", b"\x12", b"\x1a"


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _frame(header: bytes | None, meta: bytes | None, data: memoryview) -> bytes:
    parts: list[bytes | memoryview] = []
    if header is not None:
        parts += [_HEADER_KEY, _varint(len(header)), header]
    if meta is not None:
        parts += [_TENSOR_KEY, _varint(len(meta)), meta]
    if len(data):
        parts += [_DATA_KEY, _varint(len(data)), data]
    return b"".join(parts)


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


def encode_model(
    state: Mapping[str, torch.Tensor], info: StreamInfo, *, chunk_size: int = CHUNK_SIZE, codec: str = "none"
) -> Iterator[pb.Chunk]:
    """Encodes ``state`` and yields its chunk stream (see ``EncodedModel``)."""
    return EncodedModel(state, codec=codec).chunks(info, chunk_size=chunk_size)


_NO_BYTES = np.empty(0, dtype=np.uint8)


class ModelAssembler:
    """Rebuilds named tensors from a chunk stream, validating as it goes.

    Args:
        expected: when given, the stream must hold exactly these tensors (names, dtypes,
            shapes), in any order.
        max_tensor_bytes: no tensor larger than this is accepted or allocated.
        max_total_bytes: cap on the whole stream's payload.
        sink: when given, each tensor is handed to ``sink(name, tensor)`` as soon as it is
            complete and verified, and not kept (``finish`` then returns no tensors): a
            receiver can write an update to disk holding one tensor at a time.
        buffers: where tensor buffers come from (default: the process's ``receive_buffers()``):
            a raw tensor is its buffer, handed out again once the tensor and everything made
            from it are gone.

    Raises (from ``feed`` and ``finish``):
        InvalidUpdateError: the stream breaks a rule; the message names the tensor and problem.
        PayloadTooLargeError: a tensor or the stream exceeds what it declared or the caps.
    """

    def __init__(
        self,
        *,
        expected: Mapping[str, TensorSpec] | None = None,
        max_tensor_bytes: int = MAX_TENSOR_BYTES,
        max_total_bytes: int | None = None,
        sink: Callable[[str, torch.Tensor], None] | None = None,
        buffers: BufferPool | None = None,
    ) -> None:
        self._expected = expected
        self._buffers = receive_buffers() if buffers is None else buffers
        self._sink = sink
        self._done: list[str] = []
        self._max_tensor_bytes = max_tensor_bytes
        self._max_total_bytes = max_total_bytes
        self.info: StreamInfo | None = None
        self._num_tensors = 0
        self._total_bytes = 0
        self._received_total = 0
        self.wire_bytes = 0
        #: Messages taken so far: what a resumed upload continues from.
        self.frames_received = 0
        self.tensors: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._meta: pb.TensorMeta | None = None
        self._buf: torch.Tensor | None = None
        self._view: np.ndarray = _NO_BYTES
        self._filled = 0
        self._hasher: "xxhash.xxh3_64 | None" = None

    @property
    def payload_bytes(self) -> int:
        """Payload bytes received so far."""
        return self._received_total

    def feed(self, chunk: pb.Chunk | bytes | memoryview) -> None:
        """Takes the next message of the stream, as an encoded ``Chunk`` or a message object."""
        frame = chunk.SerializeToString() if isinstance(chunk, pb.Chunk) else chunk
        self.wire_bytes += len(frame) + GRPC_FRAME_BYTES
        header, tensor, data = parse_frame(frame)
        if self.info is None:
            if header is None:
                raise InvalidUpdateError("stream does not start with a header")
            self._start_stream(_parse(pb.StreamHeader, header, "stream header"))
        elif header is not None:
            raise InvalidUpdateError("stream carries a second header")
        if tensor is not None:
            self._close_tensor()
            self._open_tensor(_parse(pb.TensorMeta, tensor, "tensor meta"))
        if data is not None and len(data):
            self._append(data)
        self.frames_received += 1

    @property
    def ended_early(self) -> bool:
        """The stream stopped short of the payload its header declared (cut, or cut short):
        what arrived is verified and more frames may still be fed."""
        return self.info is not None and self._received_total < self._total_bytes

    def finish(self) -> tuple[StreamInfo, "OrderedDict[str, torch.Tensor]"]:
        """Checks the stream is complete and returns its header and tensors."""
        if self.info is None:
            raise InvalidUpdateError("empty stream: no header received")
        self._close_tensor()
        if self._expected is not None:
            missing = [n for n in self._expected if n not in self._done]
            if missing:
                raise InvalidUpdateError(f"truncated stream: missing tensors {missing[:5]} (expected {len(self._expected)})")
            if self._sink is None:
                self.tensors = OrderedDict((n, self.tensors[n]) for n in self._expected)
        if len(self._done) != self._num_tensors:
            raise InvalidUpdateError(
                f"truncated stream: header declared {self._num_tensors} tensors, received {len(self._done)}"
            )
        if self._received_total != self._total_bytes:
            raise InvalidUpdateError(
                f"stream declared {self._total_bytes} payload bytes, received {self._received_total}"
            )
        return self.info, self.tensors

    # -- internals -----------------------------------------------------------------------
    def _start_stream(self, header: pb.StreamHeader) -> None:
        if self._expected is not None and header.num_tensors != len(self._expected):
            raise InvalidUpdateError(
                f"tensor count: header declares {header.num_tensors} tensors, expected {len(self._expected)}"
            )
        if self._max_total_bytes is not None and header.total_bytes > self._max_total_bytes:
            raise PayloadTooLargeError(
                f"stream declares {header.total_bytes} payload bytes, over the limit of {self._max_total_bytes}"
            )
        check_metrics(header.metrics)
        self._num_tensors = header.num_tensors
        self._total_bytes = header.total_bytes
        self.info = _info(header)

    def _open_tensor(self, meta: pb.TensorMeta) -> None:
        name = meta.name
        if not name:
            raise InvalidUpdateError("tensor with an empty name")
        if name in self._done:
            raise InvalidUpdateError(f"tensor {escape(name)} sent twice")
        if len(self._done) >= self._num_tensors:
            raise InvalidUpdateError(f"tensor count: '{name}' is beyond the {self._num_tensors} tensors declared")
        dtype = PB_TO_DTYPE.get(meta.dtype)
        if dtype is None:
            raise InvalidUpdateError(f"tensor {escape(name)}: unknown dtype {meta.dtype}")
        shape = tuple(meta.shape)
        if any(d < 0 for d in shape):
            raise InvalidUpdateError(f"tensor {escape(name)}: negative dimension in shape {list(shape)}")
        if self._expected is not None:
            spec = self._expected.get(name)
            if spec is None:
                raise InvalidUpdateError(f"tensor {escape(name)} is not part of the model")
            if dtype != spec.dtype:
                raise InvalidUpdateError(f"tensor {escape(name)}: wrong dtype {dtype}, expected {spec.dtype}")
            if shape != spec.shape:
                raise InvalidUpdateError(f"tensor {escape(name)}: wrong shape {list(shape)}, expected {list(spec.shape)}")
        try:
            codec = get_codec(meta.codec)
        except InvalidUpdateError as exc:
            raise InvalidUpdateError(f"tensor {escape(name)}: {exc}") from None
        limit = min(codec.max_payload_bytes(dtype=dtype, shape=shape), self._max_tensor_bytes)
        if meta.nbytes > limit:
            raise PayloadTooLargeError(
                f"tensor {escape(name)}: declares {meta.nbytes} payload bytes, over the {limit} its dtype, shape and codec allow"
            )
        if self._received_total + meta.nbytes > self._total_bytes:
            raise PayloadTooLargeError(f"tensor {escape(name)}: payload runs past the stream's declared total")
        raw_size = _numel(shape) * _itemsize(dtype)
        if meta.codec == "none" and meta.nbytes != raw_size:
            raise InvalidUpdateError(f"tensor {escape(name)}: payload is {meta.nbytes} bytes, {dtype} {list(shape)} needs {raw_size}")
        self._meta = meta
        # A reused buffer if one of this size is free: faulting in a fresh model-sized one is
        # most of a receiver's cost (see proto/buffers.py). No zero fill: every byte is written
        # before the tensor exists (_close_tensor raises on a short one).
        self._view = self._buffers.take(meta.nbytes)
        self._buf = torch.from_numpy(self._view)
        self._filled = 0
        self._hasher = xxhash.xxh3_64()

    def _append(self, data: memoryview) -> None:
        if self._meta is None or self._buf is None or self._hasher is None:
            raise InvalidUpdateError("data chunk before any tensor header")
        end = self._filled + len(data)
        if end > self._buf.numel():
            raise PayloadTooLargeError(
                f"tensor {escape(self._meta.name)}: larger than declared ({end} > {self._buf.numel()} bytes)"
            )
        self._view[self._filled : end] = np.frombuffer(data, dtype=np.uint8)
        self._hasher.update(data)
        self._filled = end
        self._received_total += len(data)

    def _close_tensor(self) -> None:
        meta, buf = self._meta, self._buf
        if meta is None or buf is None or self._hasher is None:
            return
        name = meta.name
        if self._filled != buf.numel():
            raise InvalidUpdateError(f"tensor {escape(name)}: truncated, received {self._filled} of {buf.numel()} bytes")
        if self._hasher.intdigest() != meta.checksum:
            raise InvalidUpdateError(f"tensor {escape(name)}: checksum mismatch")
        dtype, shape = PB_TO_DTYPE[meta.dtype], tuple(meta.shape)
        if meta.codec == "none":  # raw bytes: the received buffer is the tensor, no copy
            tensor = buf.view(dtype).reshape(shape) if buf.numel() else torch.empty(shape, dtype=dtype)
        else:
            try:
                tensor = get_codec(meta.codec).decode(bytearray(self._view), dtype=dtype, shape=shape)
            except InvalidUpdateError as exc:
                raise InvalidUpdateError(f"tensor {escape(name)}: {exc}") from None
        self._done.append(name)
        # Let go of the buffer: a raw tensor holds it (the pool gets it back when the tensor
        # is gone), a decoded one was copied out and it is free now.
        self._meta, self._buf, self._hasher, self._view = None, None, None, _NO_BYTES
        if self._sink is not None:
            self._sink(name, tensor)
        else:
            self.tensors[name] = tensor


def _info(header: pb.StreamHeader) -> StreamInfo:
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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _parse(kind: type[M], data: memoryview, what: str) -> M:
    try:
        return kind.FromString(data.tobytes())
    except DecodeError:
        raise InvalidUpdateError(f"malformed chunk: cannot decode the {what}") from None


def check_finite(state: Mapping[str, torch.Tensor]) -> None:
    """Raises ``InvalidUpdateError`` naming the first tensor that holds NaN or Inf."""
    for name, tensor in state.items():
        if not (tensor.dtype.is_floating_point or tensor.dtype.is_complex) or not tensor.numel():
            continue
        probe = torch.view_as_real(tensor) if tensor.dtype.is_complex else tensor
        if probe.dtype.itemsize == 1:  # float8 has no reductions
            probe = probe.float()
        # One pass: NaN propagates into min and max, an infinity becomes one of them.
        low, high = torch.aminmax(probe)
        if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
            bad = "NaN" if bool(torch.isnan(probe).any()) else "Inf"
            raise InvalidUpdateError(f"tensor {escape(name)}: contains {bad}")


def decode_chunks(
    chunks: Iterable[pb.Chunk | bytes],
    *,
    expected: Mapping[str, TensorSpec] | None = None,
    max_tensor_bytes: int = MAX_TENSOR_BYTES,
    max_total_bytes: int | None = None,
) -> tuple[StreamInfo, "OrderedDict[str, torch.Tensor]"]:
    """Assembles a whole stream (see ``ModelAssembler``)."""
    asm = ModelAssembler(expected=expected, max_tensor_bytes=max_tensor_bytes, max_total_bytes=max_total_bytes)
    for chunk in chunks:
        asm.feed(chunk)
    return asm.finish()


# -- small messages ------------------------------------------------------------------------
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
    )


def fit_ins_from_task(task: pb.Task) -> FitIns:
    return FitIns(round=task.round, config=config_from_pb(task.config))


def message_ins_from_task(task: pb.Task, client_id: str) -> MessageIns:
    """The ``MessageIns`` of a ``MESSAGE`` task polled by ``client_id``."""
    return MessageIns(round=task.round, phase=task.phase, client_id=client_id, peers=tuple(task.peers), config=config_from_pb(task.config))


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
