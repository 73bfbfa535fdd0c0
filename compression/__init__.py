"""Two-sided codecs for tensors on the wire (encode on one end, decode on the other)."""

from fedgrid.compression.base import Codec, IdentityCodec, available_codecs, get_codec, register_codec

__all__ = ["Codec", "IdentityCodec", "available_codecs", "get_codec", "register_codec"]
