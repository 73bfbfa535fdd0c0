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
from typing import Iterable, Iterator, Mapping

import torch
import xxhash

from fedgrid.compression import get_codec
from fedgrid.constants import CHUNK_SIZE, MAX_TENSOR_BYTES
from fedgrid.errors import InvalidUpdateError, PayloadTooLargeError
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.types import ClientInfo, FitIns, ModelState, Scalar, TensorSpec

__all__ = [
    "DTYPE_TO_PB",
    "PB_TO_DTYPE",
    "TensorSpec",
    "StreamInfo",
    "EncodedModel",
    "encode_model",
    "ModelAssembler",
    "decode_chunks",
    "check_finite",
    "checksum",
    "wire_size",
    "config_to_pb",
    "config_from_pb",
    "capabilities_to_pb",
    "client_info_from_join",
    "fit_ins_from_task",
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

#: gRPC's length-prefixed message framing: 1 flag byte + 4 length bytes per message.
GRPC_FRAME_BYTES = 5


def checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of ``data``: about 9 GB/s here, over twice zlib's CRC32, so it costs little."""
    return xxhash.xxh3_64_intdigest(data)


def wire_size(message: pb.Chunk) -> int:
    """Bytes a message occupies on the wire: its encoding plus gRPC's message framing."""
    return message.ByteSize() + GRPC_FRAME_BYTES


@dataclass(frozen=True)
class StreamInfo:
    """The header of a chunk stream, as plain Python."""

    run_id: str = ""
    task_id: str = ""
    round: int = 0
    client_id: str = ""
    session_token: str = ""
    num_examples: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)


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
                raise InvalidUpdateError(f"tensor '{name}': dtype {tensor.dtype} cannot be sent")
            payload = memoryview(impl.encode(tensor)).cast("B")
            meta = pb.TensorMeta(
                name=name,
                dtype=DTYPE_TO_PB[tensor.dtype],
                shape=list(tensor.shape),
                codec=codec,
                nbytes=len(payload),
                checksum=checksum(payload),
            )
            self._tensors.append(_Encoded(meta, payload))
        self.total_bytes = sum(t.meta.nbytes for t in self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def chunks(self, info: StreamInfo, *, chunk_size: int = CHUNK_SIZE) -> Iterator[pb.Chunk]:
        """Yields the stream: header on the first message, then each tensor's meta and payload."""
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        header = pb.StreamHeader(
            run_id=info.run_id,
            task_id=info.task_id,
            round=info.round,
            num_tensors=len(self._tensors),
            total_bytes=self.total_bytes,
            client_id=info.client_id,
            session_token=info.session_token,
            num_examples=info.num_examples,
            metrics=dict(info.metrics),
        )
        pending_header: pb.StreamHeader | None = header
        for enc in self._tensors:
            n = len(enc.payload)
            first = True
            for start in range(0, max(n, 1), chunk_size):
                msg = pb.Chunk(data=enc.payload[start : start + chunk_size].tobytes())
                if first:
                    msg.tensor.CopyFrom(enc.meta)
                    first = False
                if pending_header is not None:
                    msg.header.CopyFrom(pending_header)
                    pending_header = None
                yield msg
        if pending_header is not None:  # a model with no tensors is just its header
            yield pb.Chunk(header=pending_header)


def encode_model(
    state: Mapping[str, torch.Tensor], info: StreamInfo, *, chunk_size: int = CHUNK_SIZE, codec: str = "none"
) -> Iterator[pb.Chunk]:
    """Encodes ``state`` and yields its chunk stream (see ``EncodedModel``)."""
    return EncodedModel(state, codec=codec).chunks(info, chunk_size=chunk_size)


class ModelAssembler:
    """Rebuilds named tensors from a chunk stream, validating as it goes.

    Args:
        expected: when given, the stream must hold exactly these tensors (names, dtypes,
            shapes), in any order.
        max_tensor_bytes: no tensor larger than this is accepted or allocated.
        max_total_bytes: cap on the whole stream's payload.

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
    ) -> None:
        self._expected = expected
        self._max_tensor_bytes = max_tensor_bytes
        self._max_total_bytes = max_total_bytes
        self.info: StreamInfo | None = None
        self._num_tensors = 0
        self._total_bytes = 0
        self._received_total = 0
        self.wire_bytes = 0
        self.tensors: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._meta: pb.TensorMeta | None = None
        self._buf: bytearray | None = None
        self._filled = 0
        self._hasher: "xxhash.xxh3_64 | None" = None

    @property
    def payload_bytes(self) -> int:
        """Payload bytes received so far."""
        return self._received_total

    def feed(self, chunk: pb.Chunk) -> None:
        self.wire_bytes += wire_size(chunk)
        if self.info is None:
            if not chunk.HasField("header"):
                raise InvalidUpdateError("stream does not start with a header")
            self._start_stream(chunk.header)
        elif chunk.HasField("header"):
            raise InvalidUpdateError("stream carries a second header")
        if chunk.HasField("tensor"):
            self._close_tensor()
            self._open_tensor(chunk.tensor)
        if chunk.data:
            self._append(chunk.data)

    def finish(self) -> tuple[StreamInfo, "OrderedDict[str, torch.Tensor]"]:
        """Checks the stream is complete and returns its header and tensors."""
        if self.info is None:
            raise InvalidUpdateError("empty stream: no header received")
        self._close_tensor()
        if self._expected is not None:
            missing = [n for n in self._expected if n not in self.tensors]
            if missing:
                raise InvalidUpdateError(f"truncated stream: missing tensors {missing[:5]} (expected {len(self._expected)})")
            self.tensors = OrderedDict((n, self.tensors[n]) for n in self._expected)
        if len(self.tensors) != self._num_tensors:
            raise InvalidUpdateError(
                f"truncated stream: header declared {self._num_tensors} tensors, received {len(self.tensors)}"
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
        for key, value in header.metrics.items():
            if not math.isfinite(value):
                raise InvalidUpdateError(f"metric '{key}' is {value}")
        self._num_tensors = header.num_tensors
        self._total_bytes = header.total_bytes
        self.info = StreamInfo(
            run_id=header.run_id,
            task_id=header.task_id,
            round=header.round,
            client_id=header.client_id,
            session_token=header.session_token,
            num_examples=header.num_examples,
            metrics=dict(header.metrics),
        )

    def _open_tensor(self, meta: pb.TensorMeta) -> None:
        name = meta.name
        if not name:
            raise InvalidUpdateError("tensor with an empty name")
        if name in self.tensors:
            raise InvalidUpdateError(f"tensor '{name}' sent twice")
        if len(self.tensors) >= self._num_tensors:
            raise InvalidUpdateError(f"tensor count: '{name}' is beyond the {self._num_tensors} tensors declared")
        dtype = PB_TO_DTYPE.get(meta.dtype)
        if dtype is None:
            raise InvalidUpdateError(f"tensor '{name}': unknown dtype {meta.dtype}")
        shape = tuple(meta.shape)
        if any(d < 0 for d in shape):
            raise InvalidUpdateError(f"tensor '{name}': negative dimension in shape {list(shape)}")
        if self._expected is not None:
            spec = self._expected.get(name)
            if spec is None:
                raise InvalidUpdateError(f"tensor '{name}' is not part of the model")
            if dtype != spec.dtype:
                raise InvalidUpdateError(f"tensor '{name}': wrong dtype {dtype}, expected {spec.dtype}")
            if shape != spec.shape:
                raise InvalidUpdateError(f"tensor '{name}': wrong shape {list(shape)}, expected {list(spec.shape)}")
        try:
            codec = get_codec(meta.codec)
        except InvalidUpdateError as exc:
            raise InvalidUpdateError(f"tensor '{name}': {exc}") from None
        limit = min(codec.max_payload_bytes(dtype=dtype, shape=shape), self._max_tensor_bytes)
        if meta.nbytes > limit:
            raise PayloadTooLargeError(
                f"tensor '{name}': declares {meta.nbytes} payload bytes, over the {limit} its dtype, shape and codec allow"
            )
        if self._received_total + meta.nbytes > self._total_bytes:
            raise PayloadTooLargeError(f"tensor '{name}': payload runs past the stream's declared total")
        self._meta = meta
        self._buf = bytearray(meta.nbytes)
        self._filled = 0
        self._hasher = xxhash.xxh3_64()

    def _append(self, data: bytes) -> None:
        if self._meta is None or self._buf is None or self._hasher is None:
            raise InvalidUpdateError("data chunk before any tensor header")
        end = self._filled + len(data)
        if end > len(self._buf):
            raise PayloadTooLargeError(
                f"tensor '{self._meta.name}': larger than declared ({end} > {len(self._buf)} bytes)"
            )
        self._buf[self._filled : end] = data
        self._hasher.update(data)
        self._filled = end
        self._received_total += len(data)

    def _close_tensor(self) -> None:
        meta, buf = self._meta, self._buf
        if meta is None or buf is None or self._hasher is None:
            return
        name = meta.name
        if self._filled != len(buf):
            raise InvalidUpdateError(f"tensor '{name}': truncated, received {self._filled} of {len(buf)} bytes")
        if self._hasher.intdigest() != meta.checksum:
            raise InvalidUpdateError(f"tensor '{name}': checksum mismatch")
        dtype, shape = PB_TO_DTYPE[meta.dtype], tuple(meta.shape)
        try:
            tensor = get_codec(meta.codec).decode(buf, dtype=dtype, shape=shape)
        except InvalidUpdateError as exc:
            raise InvalidUpdateError(f"tensor '{name}': {exc}") from None
        self.tensors[name] = tensor
        self._meta, self._buf, self._hasher = None, None, None


def check_finite(state: Mapping[str, torch.Tensor]) -> None:
    """Raises ``InvalidUpdateError`` naming the first tensor that holds NaN or Inf."""
    for name, tensor in state.items():
        if (tensor.dtype.is_floating_point or tensor.dtype.is_complex) and tensor.numel():
            probe = tensor if tensor.dtype.itemsize > 1 else tensor.float()
            if not bool(torch.isfinite(probe).all()):
                bad = "NaN" if bool(torch.isnan(probe).any()) else "Inf"
                raise InvalidUpdateError(f"tensor '{name}': contains {bad}")


def decode_chunks(
    chunks: Iterable[pb.Chunk], *, expected: Mapping[str, TensorSpec] | None = None, **limits: int
) -> tuple[StreamInfo, "OrderedDict[str, torch.Tensor]"]:
    """Assembles a whole stream (see ``ModelAssembler``)."""
    asm = ModelAssembler(expected=expected, **limits)
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
