"""Two-sided codecs for tensors on the wire (encode on one end, decode on the other) and error feedback.

``get_codec(spec)`` finds any codec by its spec (``none``, ``fp16``, ``bf16``, ``int8``,
``qsgd:LEVELS``, ``topk:FRACTION``, ``randk:FRACTION``, ``powersgd:RANK``, ``sign``, and for
DiLoCo's outer gradients ``int4[:BLOCK]``, ``fp4[:BLOCK]``, ``sparseloco[:K]``, ``demo[:K]``; each optionally ``+zstd``); see ``fedgrid.compression.registry`` for the grammar and each codec's
module for its payload format and error bound.
"""

from fedgrid.compression.base import LOSSY_DTYPES, Codec, FloatCodec, IdentityCodec
from fedgrid.compression.dct import DCTTopKCodec
from fedgrid.compression.feedback import (
    DownlinkUpdate,
    ErrorFeedback,
    FeedbackRule,
    ShadowModel,
    Transmitted,
    apply_delta,
    apply_downlink,
)
from fedgrid.compression.lossless import ZstdCodec
from fedgrid.compression.lowbit import FP4Codec, Int4Codec
from fedgrid.compression.lowrank import PowerSGDCodec
from fedgrid.compression.quantize import CastCodec, Int8Codec, QSGDCodec, SignCodec
from fedgrid.compression.registry import (
    available_codecs,
    get_codec,
    parse_codec_spec,
    register_codec,
    register_codec_family,
)
from fedgrid.compression.sparse import RandKCodec, SparseCodec, TopKCodec
from fedgrid.compression.sparseloco import SparseLoCoCodec
from fedgrid.compression.spec import CodecSpec

__all__ = [
    "LOSSY_DTYPES",
    "Codec",
    "CodecSpec",
    "FloatCodec",
    "IdentityCodec",
    "CastCodec",
    "Int8Codec",
    "QSGDCodec",
    "SignCodec",
    "SparseCodec",
    "TopKCodec",
    "RandKCodec",
    "PowerSGDCodec",
    "Int4Codec",
    "FP4Codec",
    "SparseLoCoCodec",
    "DCTTopKCodec",
    "ZstdCodec",
    "ErrorFeedback",
    "FeedbackRule",
    "Transmitted",
    "ShadowModel",
    "DownlinkUpdate",
    "apply_delta",
    "apply_downlink",
    "available_codecs",
    "get_codec",
    "parse_codec_spec",
    "register_codec",
    "register_codec_family",
]
