"""Codec specs and the registry: ``get_codec("topk:0.01")``, ``parse_codec_spec("int8+zstd")``.

A spec is ``NAME[:PARAM][+zstd[:LEVEL]]``:

=====================  ===========================================================
``none``               raw bytes, lossless
``fp16`` / ``bf16``    16-bit floats
``int8[:BLOCK]``       8-bit codes, one absmax per ``BLOCK`` elements (256)
``qsgd[:LEVELS]``      stochastic unbiased quantization, 1..32767 levels (127: a byte each)
``topk[:FRACTION]``    the largest-magnitude ``FRACTION`` of elements, in (0, 1] (0.1);
                       ``topk:F:scaled`` scales them by ``||x||^2 / ||topk(x)||^2``
``randk[:FRACTION]``   a uniform random ``FRACTION`` of elements; ``randk:F:unbiased``
                       scales them by ``1/F`` (bare ``randk``: ``randk:0.25:unbiased``)
``powersgd[:RANK]``    rank-``RANK`` factors of matrices and conv kernels (4)
``sign[:BLOCK]``       1 bit per element of randomly rotated blocks (256), scaled per block
``int4[:BLOCK]``       4-bit integer codes, one absmax per ``BLOCK`` elements (256)
``fp4[:BLOCK]``        4-bit e2m1 floats, one absmax per ``BLOCK`` elements (256)
``sparseloco[:K]``     top-``K`` of every 4096 elements (64), 2 bits per kept value;
                       ``sparseloco:K:scaled`` scales each chunk's magnitudes as ``topk:F:scaled``
``demo[:K]``           top-``K`` 2-D DCT-II coefficients of every 4096 elements (64), 2 bits each;
                       ``demo:K:scaled`` scales each chunk's magnitudes as ``sparseloco:K:scaled``
``SPEC+zstd[:LEVEL]``  zstd over any of the above (``none+zstd`` alone is lossless)
=====================  ===========================================================

``get_codec`` is the receiver's entry point: it returns one shared instance per spec (so a
stream of many tensors parses each spec once) and raises ``InvalidUpdateError``, which the
servicer maps to INVALID_ARGUMENT. Shared instances are fine for decoding and for stateless
encoding; a sender that wants warm start (``powersgd`` with ``key=``) holds its own instance
from ``parse_codec_spec``, which builds a fresh one and raises ``ConfigError`` for config-time
validation.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import torch

from fedgrid.compression.base import Codec, IdentityCodec
from fedgrid.compression.dct import DCTTopKCodec, ScaledDCTTopKCodec
from fedgrid.compression.lossless import ZstdCodec
from fedgrid.compression.lowbit import DEFAULT_BLOCK_4BIT, FP4Codec, Int4Codec
from fedgrid.compression.lowrank import PowerSGDCodec
from fedgrid.compression.quantize import SIGN_BLOCK, CastCodec, Int8Codec, QSGDCodec, SignCodec
from fedgrid.compression.sparse import DEFAULT_RANDK, DEFAULT_TOPK, RandKCodec, ScaledTopKCodec, TopKCodec
from fedgrid.compression.sparseloco import CHUNK, DEFAULT_K, ScaledSparseLoCoCodec, SparseLoCoCodec
from fedgrid.errors import ConfigError, InvalidUpdateError

__all__ = [
    "CodecFactory",
    "MAX_SPEC_LENGTH",
    "register_codec",
    "register_codec_family",
    "get_codec",
    "parse_codec_spec",
    "available_codecs",
]

#: Builds a codec of a family from the text after ``NAME:`` (``None`` when there is none).
CodecFactory = Callable[[str | None], Codec]

#: Longest spec accepted; a spec arrives from the network in every ``TensorMeta``.
MAX_SPEC_LENGTH = 64
_NAME = re.compile(r"[a-z0-9_]+")
_CACHE_SIZE = 256


@dataclass(frozen=True)
class _Family:
    factory: CodecFactory
    usage: str  # how the spec is written, for messages: "topk:FRACTION"


def _no_param(codec: Codec) -> CodecFactory:
    def factory(param: str | None) -> Codec:
        if param is not None:
            raise ValueError(f"codec '{codec.name}' takes no parameter, got {param!r}")
        return codec

    return factory


def _fresh(name: str, build: Callable[[], Codec]) -> CodecFactory:
    def factory(param: str | None) -> Codec:
        if param is not None:
            raise ValueError(f"codec '{name}' takes no parameter, got {param!r}")
        return build()

    return factory


def _int(param: str | None, usage: str, lo: int, hi: int, default: int | None = None) -> int:
    if param is None and default is not None:
        return default
    if param is None or not re.fullmatch(r"[0-9]{1,6}", param) or not lo <= int(param) <= hi:
        raise ValueError(f"'{usage}' needs an integer in {lo}..{hi}, got {param!r}")
    return int(param)


def _fraction(param: str | None, usage: str) -> float:
    try:
        value = float(param) if param is not None and len(param) <= 24 else math.nan
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError(f"'{usage}' needs a fraction in (0, 1], got {param!r}")
    return value


def _topk(param: str | None) -> Codec:
    if param is None:
        return TopKCodec(DEFAULT_TOPK)
    fraction, sep, form = param.partition(":")
    if sep and form != "scaled":
        raise ValueError(f"'topk:FRACTION[:scaled]' ends in ':scaled' or nothing, got {form!r}")
    value = _fraction(fraction, "topk:FRACTION[:scaled]")
    return ScaledTopKCodec(value) if sep else TopKCodec(value)


def _randk(param: str | None) -> Codec:
    if param is None:
        return RandKCodec(*DEFAULT_RANDK)
    fraction, sep, form = param.partition(":")
    if sep and form != "unbiased":
        raise ValueError(f"'randk:FRACTION[:unbiased]' ends in ':unbiased' or nothing, got {form!r}")
    return RandKCodec(_fraction(fraction, "randk:FRACTION[:unbiased]"), unbiased=bool(sep))


def _chunked(family: str, plain: Callable[..., Codec], scaled: Callable[[int], Codec]) -> CodecFactory:
    """``sparseloco[:K[:scaled]]`` and ``demo[:K[:scaled]]`` (the codec is told whether K was named)."""

    def factory(param: str | None) -> Codec:
        k, sep, form = (param or "").partition(":")
        if sep and form != "scaled":
            raise ValueError(f"'{family}:K[:scaled]' ends in ':scaled' or nothing, got {form!r}")
        kept = _int(k if param is not None else None, f"{family}[:K[:scaled]]", 1, CHUNK, DEFAULT_K)
        return scaled(kept) if sep else plain(kept, named=param is not None)

    return factory


#: A bare ``qsgd``: 127 levels a sign, one byte a coordinate (the size of an int8 upload, unbiased).
DEFAULT_QSGD_LEVELS = 127
#: A bare ``powersgd``: rank 4, what the benchmarks run (benchmarks/README.md: ``powersgd:4``).
DEFAULT_POWERSGD_RANK = 4


def _builtin() -> dict[str, _Family]:
    return {
        "none": _Family(_no_param(IdentityCodec()), "none"),
        "fp16": _Family(_fresh("fp16", lambda: CastCodec(torch.float16)), "fp16"),
        "bf16": _Family(_fresh("bf16", lambda: CastCodec(torch.bfloat16)), "bf16"),
        "int8": _Family(lambda p: Int8Codec(_int(p, "int8[:BLOCK]", 8, 65536, 256)), "int8[:BLOCK]"),
        "qsgd": _Family(
            lambda p: QSGDCodec(_int(p, "qsgd[:LEVELS]", 1, 32767, DEFAULT_QSGD_LEVELS)), "qsgd[:LEVELS]"
        ),
        "topk": _Family(_topk, "topk[:FRACTION[:scaled]]"),
        "randk": _Family(_randk, "randk[:FRACTION[:unbiased]]"),
        "powersgd": _Family(
            lambda p: PowerSGDCodec(_int(p, "powersgd[:RANK]", 1, 65535, DEFAULT_POWERSGD_RANK)),
            "powersgd[:RANK]",
        ),
        "sign": _Family(lambda p: SignCodec(_int(p, "sign[:BLOCK]", 8, 65536, SIGN_BLOCK)), "sign[:BLOCK]"),
        "int4": _Family(
            lambda p: Int4Codec(_int(p, "int4[:BLOCK]", 8, 65536, DEFAULT_BLOCK_4BIT)), "int4[:BLOCK]"
        ),
        "fp4": _Family(
            lambda p: FP4Codec(_int(p, "fp4[:BLOCK]", 8, 65536, DEFAULT_BLOCK_4BIT)), "fp4[:BLOCK]"
        ),
        "sparseloco": _Family(
            _chunked("sparseloco", SparseLoCoCodec, ScaledSparseLoCoCodec), "sparseloco[:K[:scaled]]"
        ),
        "demo": _Family(_chunked("demo", DCTTopKCodec, ScaledDCTTopKCodec), "demo[:K[:scaled]]"),
    }


_FAMILIES: dict[str, _Family] = _builtin()
_CACHE: dict[str, Codec] = {}


def register_codec(codec: Codec) -> None:
    """Makes the parameterless ``codec`` available under ``codec.name`` (shared by every user)."""
    register_codec_family(codec.name, _no_param(codec), usage=codec.name)


def register_codec_family(name: str, factory: CodecFactory, *, usage: str = "") -> None:
    """Makes ``NAME[:PARAM]`` specs build codecs with ``factory(PARAM or None)``.

    Args:
        name: lowercase letters, digits and ``_``.
        factory: raises ``ValueError`` for a parameter it rejects.
        usage: how the spec is written, shown in error messages (default ``name``).
    """
    if not name or not _NAME.fullmatch(name) or name == "zstd":
        raise ValueError(f"a codec name is lowercase letters, digits and '_', not 'zstd'; got {name!r}")
    _FAMILIES[name] = _Family(factory, usage or name)
    _CACHE.clear()


def _known() -> str:
    return ", ".join(f.usage for f in _FAMILIES.values()) + "; any may end in +zstd[:LEVEL]"


def _split(part: str) -> tuple[str, str | None]:
    name, sep, param = part.partition(":")
    return name, (param if sep else None)


def _build(spec: str) -> Codec:
    if not isinstance(spec, str) or not spec:
        raise InvalidUpdateError(f"empty codec spec (known: {_known()})")
    if len(spec) > MAX_SPEC_LENGTH:
        raise InvalidUpdateError(f"codec spec of {len(spec)} characters, over the {MAX_SPEC_LENGTH} allowed")
    base, *stages = spec.split("+")
    name, param = _split(base)
    family = _FAMILIES.get(name)
    if family is None:
        raise InvalidUpdateError(f"unknown codec {name!r} (known: {_known()})")
    try:
        codec = family.factory(param)
        if len(stages) > 1:
            raise ValueError("at most one '+zstd' stage")
        if stages:
            stage, level = _split(stages[0])
            if stage != "zstd":
                raise ValueError(f"unknown stage {stage!r} (the one stage is 'zstd[:LEVEL]')")
            codec = ZstdCodec(codec, _int(level, "zstd[:LEVEL]", 1, 22, 3))
    except ValueError as exc:
        raise InvalidUpdateError(f"codec spec {spec!r}: {exc}") from None
    return codec


def get_codec(name: str) -> Codec:
    """Returns the shared codec for spec ``name`` (e.g. ``"none"``, ``"topk:0.01"``, ``"int8+zstd"``).

    Raises:
        InvalidUpdateError: unknown codec, bad parameter or malformed spec.
    """
    codec = _CACHE.get(name)
    if codec is None:
        codec = _build(name)
        if len(_CACHE) >= _CACHE_SIZE:  # specs come off the network: keep the cache bounded
            _CACHE.clear()
        _CACHE[name] = codec
    return codec


def parse_codec_spec(spec: str, *, key: str = "codec") -> Codec:
    """Builds a fresh codec for ``spec`` (its own warm-start state), for config validation and senders.

    Args:
        spec: ``NAME[:PARAM][+zstd[:LEVEL]]``.
        key: the config key named in the error (``codec``, ``downlink_codec``, ...).

    Raises:
        ConfigError: the spec is not valid.
    """
    try:
        return _build(spec)
    except InvalidUpdateError as exc:
        raise ConfigError(key, str(exc)) from None


def available_codecs() -> tuple[str, ...]:
    """Names of the registered codec families, sorted (what a client advertises when it joins)."""
    return tuple(sorted(_FAMILIES))
