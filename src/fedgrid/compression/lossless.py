"""The lossless zstd stage: ``SPEC+zstd[:LEVEL]`` compresses any codec's payload where it pays.

Payload: one flag byte, then the inner codec's payload as is (``0``), a zstd frame of it
(``1``), or a zstd frame of it after a byte shuffle (``2``: byte ``j`` of every element
together, the Blosc trick that lets zstd find the repeated exponent bytes of raw floats;
tried only over ``none``, whose payload is whole elements). The smallest wins; the raw form
wins ties, so the payload is never more than one byte over the inner codec's.

The receiver reads the frame's declared content size and refuses a frame that declares none,
or more than the inner codec's ``max_payload_bytes``, before it decompresses anything; the
output must match the declared size and the frame must end the payload.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
import zstandard

from fedgrid.compression._payload import Reader
from fedgrid.compression.base import Codec, IdentityCodec
from fedgrid.errors import InvalidUpdateError
from fedgrid.types import UpdateRole

__all__ = ["ZstdCodec", "DEFAULT_ZSTD_LEVEL"]

DEFAULT_ZSTD_LEVEL = 3
FLAG_RAW, FLAG_ZSTD, FLAG_SHUFFLED = 0, 1, 2
#: Payloads under this many bytes are not worth a zstd frame header.
_MIN_COMPRESS = 64


def _shuffle(data: bytes | memoryview, width: int) -> bytes:
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, width).T.tobytes()


def _unshuffle(data: bytes, width: int) -> bytes:
    return np.frombuffer(data, dtype=np.uint8).reshape(width, -1).T.tobytes()


class ZstdCodec(Codec):
    """Wraps ``inner`` with a zstd stage.

    Args:
        inner: the codec whose payload is compressed.
        level: zstd level, 1..22 (the encoder's choice; decoding does not need it).
    """

    def __init__(self, inner: Codec, level: int = DEFAULT_ZSTD_LEVEL) -> None:
        if isinstance(inner, ZstdCodec):
            raise ValueError("the zstd stage is applied once")
        if not 1 <= level <= 22:
            raise ValueError(f"zstd level must be in 1..22, got {level}")
        self.inner = inner
        self.level = level
        self.lossless = inner.lossless
        self.contractive = inner.contractive
        self.unbiased = inner.unbiased
        self.auto_feedback = inner.auto_feedback
        self.auto_strategy = inner.auto_strategy
        self.stochastic = inner.stochastic
        self.name = f"{inner.name}+zstd" + ("" if level == DEFAULT_ZSTD_LEVEL else f":{level}")

    def form_under(self, role: UpdateRole) -> str:
        return self.inner.form_under(role) + self.name[len(self.inner.name) :]

    def max_payload_bytes(self, *, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
        return 1 + self.inner.max_payload_bytes(dtype=dtype, shape=shape)

    def encode(
        self, tensor: torch.Tensor, *, generator: torch.Generator | None = None, key: str | None = None
    ) -> bytes:
        inner = memoryview(self.inner.encode(tensor, generator=generator, key=key)).cast("B")
        best, flag = inner.tobytes(), FLAG_RAW
        if len(inner) >= _MIN_COMPRESS:
            compressor = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
            packed = compressor.compress(inner)
            if len(packed) < len(best):
                best, flag = packed, FLAG_ZSTD
            width = tensor.dtype.itemsize
            if isinstance(self.inner, IdentityCodec) and width > 1:
                shuffled = compressor.compress(_shuffle(inner, width))
                if len(shuffled) < len(best):
                    best, flag = shuffled, FLAG_SHUFFLED
        return bytes([flag]) + best

    def decode(
        self, payload: bytearray | bytes | memoryview, *, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        limit = self.max_payload_bytes(dtype=dtype, shape=shape)
        if len(payload) > limit:
            raise InvalidUpdateError(
                f"{self.name} payload is {len(payload)} bytes, over the {limit} a {dtype} {list(shape)} tensor allows"
            )
        reader = Reader(payload, self.name)
        flag = reader.uint(1, "flag byte")
        body = reader.rest()
        if flag == FLAG_RAW:
            return self.inner.decode(body, dtype=dtype, shape=shape)
        if flag not in (FLAG_ZSTD, FLAG_SHUFFLED):
            raise reader.fail(f"unknown flag byte {flag}")
        inner = self._decompress(reader, body, limit - 1)
        if flag == FLAG_SHUFFLED:
            width = dtype.itemsize
            if len(inner) % width:
                raise reader.fail(f"shuffled data of {len(inner)} bytes is not whole {width}-byte elements")
            inner = _unshuffle(inner, width)
        return self.inner.decode(bytearray(inner), dtype=dtype, shape=shape)

    def _decompress(self, reader: Reader, frame: memoryview, limit: int) -> bytes:
        try:
            size = zstandard.frame_content_size(frame)
        except zstandard.ZstdError as exc:
            raise reader.fail(f"corrupt zstd frame header ({exc})") from None
        if size < 0:
            raise reader.fail("zstd frame does not declare its content size")
        if size > limit:
            raise reader.fail(
                f"zstd frame decompresses to {size} bytes, over the {limit} the inner codec allows"
            )
        try:
            out = zstandard.ZstdDecompressor().decompress(
                frame, max_output_size=limit, allow_extra_data=False
            )
        except zstandard.ZstdError as exc:
            raise reader.fail(f"corrupt zstd frame ({exc})") from None
        if len(out) != size:
            raise reader.fail(f"zstd frame declared {size} bytes, decompressed to {len(out)}")
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(state)
