"""Codecs: an update's bytes on the wire (quantization, sparsification, low rank, lossless), by
spec (``get_codec("int8")``), and error feedback around a lossy one.

Names are imported on first access (``fedgrid.lazy``); they are defined in ``fedgrid.compression``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedgrid.lazy import exports

__all__ = [
    "Codec",
    "CodecSpec",
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
    "ZstdCodec",
    "ErrorFeedback",
    "FeedbackRule",
    "get_codec",
    "available_codecs",
    "parse_codec_spec",
    "register_codec",
    "register_codec_family",
]

__getattr__, __dir__ = exports(__name__, dict.fromkeys(__all__, "fedgrid.compression"), globals_=globals())

if TYPE_CHECKING:  # what type checkers and IDEs see; never executed
    from fedgrid.compression import (
        CastCodec,
        Codec,
        CodecSpec,
        ErrorFeedback,
        FeedbackRule,
        FP4Codec,
        IdentityCodec,
        Int4Codec,
        Int8Codec,
        PowerSGDCodec,
        QSGDCodec,
        RandKCodec,
        SignCodec,
        SparseCodec,
        SparseLoCoCodec,
        TopKCodec,
        ZstdCodec,
        available_codecs,
        get_codec,
        parse_codec_spec,
        register_codec,
        register_codec_family,
    )
