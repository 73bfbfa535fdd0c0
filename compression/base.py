"""The codec contract: a tensor becomes bytes on one end and the same-shaped tensor on the other.

Codecs are pure: ``encode`` and ``decode`` take tensors and bytes and return tensors and
bytes, with no I/O. The wire framing (chunks, checksums) is the transport's job.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from fedgrid.errors import InvalidUpdateError

__all__ = ["Codec", "IdentityCodec", "get_codec", "register_codec", "available_codecs"]


class Codec(ABC):
    """A two-sided codec. ``name`` is the id that travels in ``TensorMeta.codec``."""

    name: str = ""

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> bytes | memoryview:
        """Returns the payload for ``tensor`` (contiguous, on CPU)."""

    @abstractmethod
    def decode(self, payload: bytearray | bytes, *, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Rebuilds a tensor of ``dtype`` and ``shape``.

        Raises:
            InvalidUpdateError: the payload does not describe a tensor of that dtype and shape.
        """

    def max_payload_bytes(self, *, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
        """Upper bound on the payload of a tensor of this dtype and shape; receivers allocate no more."""
        return _numel(shape) * _itemsize(dtype)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class IdentityCodec(Codec):
    """``none``: the tensor's raw little-endian bytes, lossless."""

    name = "none"

    def encode(self, tensor: torch.Tensor) -> memoryview:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel() == 0:
            return memoryview(b"")
        array = flat.view(torch.uint8).numpy()
        return memoryview(array.data)

    def decode(self, payload: bytearray | bytes, *, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        expected = self.max_payload_bytes(dtype=dtype, shape=shape)
        if len(payload) != expected:
            raise InvalidUpdateError(f"payload is {len(payload)} bytes, {dtype} {list(shape)} needs {expected}")
        if expected == 0:
            return torch.empty(shape, dtype=dtype)
        buf = payload if isinstance(payload, bytearray) else bytearray(payload)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


_REGISTRY: dict[str, Codec] = {"none": IdentityCodec()}


def register_codec(codec: Codec) -> None:
    """Makes ``codec`` available under ``codec.name``."""
    if not codec.name:
        raise ValueError("a codec needs a non-empty name")
    _REGISTRY[codec.name] = codec


def get_codec(name: str) -> Codec:
    """Returns the codec registered as ``name``.

    Raises:
        InvalidUpdateError: no codec has that name.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise InvalidUpdateError(f"unknown codec {name!r} (known: {', '.join(sorted(_REGISTRY))})") from None


def available_codecs() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))
