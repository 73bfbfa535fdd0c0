"""The one conversion layer between protobuf messages and Python/torch objects.

Protobuf types stay in ``fedgrid.proto`` and in the two gRPC runtime modules
(``server/service.py`` and ``client/runtime.py``); everything else sees dataclasses and
tensors. This module is the layer's front: it re-exports the names of its parts, so callers
import ``fedgrid.proto.serde`` alone.

- ``frames``: dtype codes, ``StreamInfo`` (a stream's header) and the ``Chunk`` framing.
- ``encoding``: ``EncodedModel`` (a model encoded once, streamed many times) and
  ``stream_wire_bytes``.
- ``assembly``: ``ModelAssembler``, which rebuilds the tensors of a stream and checks every
  claim it makes before it allocates or keeps anything; ``check_metrics``, ``check_finite``.
- ``messages``: the small messages (task configs, capabilities, join requests, peer messages).
"""

from __future__ import annotations

from fedgrid.constants import CHUNK_SIZE, MAX_TENSOR_BYTES
from fedgrid.proto.assembly import MAX_METRICS, ModelAssembler, check_finite, check_metrics, decode_chunks
from fedgrid.proto.encoding import EncodedModel, encode_model, stream_wire_bytes
from fedgrid.proto.frames import (
    DTYPE_TO_PB,
    GRPC_FRAME_BYTES,
    PB_TO_DTYPE,
    StreamInfo,
    batched,
    checksum,
    parse_frame,
    read_header,
    unbatched,
    wire_size,
)
from fedgrid.proto.messages import (
    capabilities_to_pb,
    client_info_from_join,
    config_from_pb,
    config_to_pb,
    envelopes_to_pb,
    fit_ins_from_task,
    message_ins_from_task,
    outbox_from_pb,
)
from fedgrid.types import TensorSpec

__all__ = [
    "CHUNK_SIZE",
    "MAX_TENSOR_BYTES",
    "MAX_METRICS",
    "GRPC_FRAME_BYTES",
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
    "batched",
    "unbatched",
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
