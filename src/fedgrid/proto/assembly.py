"""Receiving a model: ``ModelAssembler`` rebuilds the tensors of a ``Chunk`` stream and checks
every claim the stream makes before it allocates or keeps anything; ``check_metrics`` and
``check_finite`` are the checks an update's header and tensors pass. Part of
``fedgrid.proto.serde``'s conversion layer.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable, Iterable, Mapping

import numpy as np
import torch
import xxhash

from fedgrid.compression.base import LOSSY_DTYPES
from fedgrid.compression.spec import CodecSpec
from fedgrid.constants import MAX_REPORTED_S, MAX_TENSOR_BYTES
from fedgrid.errors import InvalidUpdateError, PayloadTooLargeError
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto.buffers import BufferPool, receive_buffers
from fedgrid.proto.frames import (
    GRPC_FRAME_BYTES,
    PB_TO_DTYPE,
    StreamInfo,
    parse_frame,
    parse_message,
    stream_info,
)
from fedgrid.telemetry import SPLIT_KEYS
from fedgrid.textsafe import MAX_LABEL_CHARS, check_label, escape
from fedgrid.types import TensorSpec

__all__ = ["MAX_METRICS", "ModelAssembler", "decode_chunks", "check_metrics", "check_finite"]

#: Metrics one stream header may carry (each name a label of at most ``MAX_LABEL_CHARS``
#: printable characters: metric names end up in logs and in ``metrics.jsonl``): the
#: application's 64, and the six of the time split the client runtime adds to a fit result
#: (``fedgrid.client.timeline.SPLIT_KEYS``).
MAX_METRICS = 64 + 6


def check_metrics(metrics: Mapping[str, float]) -> None:
    """A stream's metrics: at most ``MAX_METRICS``, printable names, finite values; the fields of
    the time split (``SPLIT_KEYS``) at least 0, its seconds at most ``MAX_REPORTED_S`` and
    ``utilization`` at most 1 (the coordinator sums and plots them: ``metrics.jsonl``,
    ``/metrics``, the status page).

    Raises:
        InvalidUpdateError: naming the field and the rule broken.
    """
    if len(metrics) > MAX_METRICS:
        raise InvalidUpdateError(f"metrics: {len(metrics)} reported, at most {MAX_METRICS}")
    for key, value in metrics.items():
        check_label(key, what="metric name", limit=MAX_LABEL_CHARS)
        if not math.isfinite(value):
            raise InvalidUpdateError(f"metric {escape(key)} is {value}")
        if key not in SPLIT_KEYS:
            continue
        limit = 1.0 if key == "utilization" else MAX_REPORTED_S
        if not 0.0 <= value <= limit:
            raise InvalidUpdateError(f"metric {escape(key)} is {value:g}, outside [0, {limit:g}]")


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
        codec: when given, the codec every tensor must name in its ``TensorMeta.codec`` (an
            upload's: its task's uplink codec); a tensor of a dtype that lossy codecs do not
            compress (integers, bool: ``LOSSY_DTYPES``) may also come raw, in any lossless codec.

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
        codec: CodecSpec | None = None,
    ) -> None:
        self._expected = expected
        self._codec = codec
        self._tensor_codec: CodecSpec = CodecSpec.NONE
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
            self._start_stream(parse_message(pb.StreamHeader, header, "stream header"))
        elif header is not None:
            raise InvalidUpdateError("stream carries a second header")
        if tensor is not None:
            self._close_tensor()
            self._open_tensor(parse_message(pb.TensorMeta, tensor, "tensor meta"))
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
                raise InvalidUpdateError(
                    f"truncated stream: missing tensors {missing[:5]} (expected {len(self._expected)})"
                )
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
        self.info = stream_info(header)

    def _open_tensor(self, meta: pb.TensorMeta) -> None:
        name = meta.name
        if not name:
            raise InvalidUpdateError("tensor with an empty name")
        if name in self._done:
            raise InvalidUpdateError(f"tensor {escape(name)} sent twice")
        if len(self._done) >= self._num_tensors:
            raise InvalidUpdateError(
                f"tensor count: '{name}' is beyond the {self._num_tensors} tensors declared"
            )
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
                raise InvalidUpdateError(
                    f"tensor {escape(name)}: wrong shape {list(shape)}, expected {list(spec.shape)}"
                )
        try:
            sent = CodecSpec.read(meta.codec)
        except InvalidUpdateError as exc:
            raise InvalidUpdateError(f"tensor {escape(name)}: {exc}") from None
        wanted = self._codec
        if wanted is not None and sent != wanted and not (sent.lossless and dtype not in LOSSY_DTYPES):
            raise InvalidUpdateError(
                f"tensor {escape(name)}: sent with codec {escape(meta.codec)}, "
                f"the task asked for {escape(wanted.text)}"
            )
        codec = sent.decoder
        limit = min(codec.max_payload_bytes(dtype=dtype, shape=shape), self._max_tensor_bytes)
        if meta.nbytes > limit:
            raise PayloadTooLargeError(
                f"tensor {escape(name)}: declares {meta.nbytes} payload bytes, over the {limit} its dtype, shape and codec allow"
            )
        if self._received_total + meta.nbytes > self._total_bytes:
            raise PayloadTooLargeError(
                f"tensor {escape(name)}: payload runs past the stream's declared total"
            )
        raw_size = _numel(shape) * _itemsize(dtype)
        if meta.codec == "none" and meta.nbytes != raw_size:
            raise InvalidUpdateError(
                f"tensor {escape(name)}: payload is {meta.nbytes} bytes, {dtype} {list(shape)} needs {raw_size}"
            )
        self._meta, self._tensor_codec = meta, sent
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
            raise InvalidUpdateError(
                f"tensor {escape(name)}: truncated, received {self._filled} of {buf.numel()} bytes"
            )
        if self._hasher.intdigest() != meta.checksum:
            raise InvalidUpdateError(f"tensor {escape(name)}: checksum mismatch")
        dtype, shape = PB_TO_DTYPE[meta.dtype], tuple(meta.shape)
        if meta.codec == "none":  # raw bytes: the received buffer is the tensor, no copy
            tensor = buf.view(dtype).reshape(shape) if buf.numel() else torch.empty(shape, dtype=dtype)
        else:
            try:
                tensor = self._tensor_codec.decoder.decode(bytearray(self._view), dtype=dtype, shape=shape)
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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
    codec: CodecSpec | None = None,
) -> tuple[StreamInfo, "OrderedDict[str, torch.Tensor]"]:
    """Assembles a whole stream (see ``ModelAssembler``)."""
    asm = ModelAssembler(
        expected=expected, max_tensor_bytes=max_tensor_bytes, max_total_bytes=max_total_bytes, codec=codec
    )
    for chunk in chunks:
        asm.feed(chunk)
    return asm.finish()
