"""The codec as a value: ``CodecSpec`` is a spec read once, where it comes in, and passed on as is.

A spec comes in at two edges, and each has one function that reads it:

- configuration (a run's ``codec``, ``downlink_codec``, ``region_codecs``, ``lan_codec``:
  ``fedgrid.config_compression.run_codecs``, run once as ``Config.codecs``): ``CodecSpec.parse``,
  which raises ``ConfigError`` naming the key, before any work starts;
- the wire, where a spec is text because protobuf carries text (a task's uplink codec at the
  client: ``fedgrid.config_compression.task_uplink_codec``; a tensor's ``TensorMeta.codec`` at
  any receiver: ``fedgrid.proto.assembly``; a client's saved uplink state): ``CodecSpec.read``,
  which raises ``InvalidUpdateError`` (INVALID_ARGUMENT at a servicer).

Everything downstream takes the value: whether it is lossless, its family (what a client's
advertised codec list names), a fresh codec to encode with (``build``: its own warm start) or
the shared one to decode with (``decoder``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from fedgrid.compression.base import Codec, IdentityCodec
from fedgrid.compression.registry import get_codec, parse_codec_spec
from fedgrid.errors import ConfigError, InvalidUpdateError
from fedgrid.types import UpdateRole

__all__ = ["CodecSpec", "parse_region_codecs"]


@dataclass(frozen=True)
class CodecSpec:
    """A codec spec that parsed.

    Two specs are equal when they name the same codec (``topk`` and ``topk:0.1``): equality
    compares ``name``, not the text as written.

    Attributes:
        text: the spec as written (what a task's config carries, unchanged from the run's
            configuration).
        name: the codec's own spec, the canonical one (what its encoder writes in each
            ``TensorMeta.codec``).
        family: the part before the first ``:`` or ``+`` (``topk`` for ``topk:0.01+zstd``), what
            a client's advertised codec list names.
        lossless: ``decode(encode(x))`` is ``x`` bit for bit (``none``, ``none+zstd``): such an
            uplink sends values, every lossy one differences.
        decoder: the shared codec of this spec (``get_codec``'s), for decoding and for encoding
            without state; a sender with warm-start state makes its own with ``build()``.
    """

    text: str = field(compare=False)
    name: str
    family: str = field(compare=False)
    lossless: bool = field(compare=False)
    decoder: Codec = field(compare=False, repr=False)

    #: ``none``: raw bytes, what a task that names no codec uses.
    NONE: ClassVar["CodecSpec"]

    @classmethod
    def parse(cls, text: str, *, key: str = "codec") -> "CodecSpec":
        """Reads a spec of the configuration (``NAME[:PARAM][+zstd[:LEVEL]]``).

        Args:
            key: the config key named in the error (``codec``, ``downlink_codec``, ...).

        Raises:
            ConfigError: the spec is not valid.
        """
        try:
            return cls.read(text)
        except InvalidUpdateError as exc:
            raise ConfigError(key, str(exc)) from None

    @classmethod
    def read(cls, text: str) -> "CodecSpec":
        """Reads a spec that came off the wire (its codec is the shared instance, built once per
        spec, see ``fedgrid.compression.registry.get_codec``).

        Raises:
            InvalidUpdateError: unknown codec, bad parameter or malformed spec.
        """
        return cls._of(text, get_codec(text))

    @classmethod
    def of(cls, codec: Codec) -> "CodecSpec":
        """The spec of a codec built elsewhere (its ``name``); ``decoder`` is ``codec`` itself."""
        return cls._of(codec.name, codec)

    @classmethod
    def _of(cls, text: str, codec: Codec) -> "CodecSpec":
        family = text.split("+", 1)[0].split(":", 1)[0]
        return cls(text=text, name=codec.name, family=family, lossless=codec.lossless, decoder=codec)

    def build(self) -> Codec:
        """A fresh codec of this spec, for a sender that keeps warm-start state (``powersgd``)."""
        return parse_codec_spec(self.text)

    def form_under(self, role: UpdateRole) -> "CodecSpec":
        """The form this codec is sent as under a strategy of ``role`` (``Codec.form_under``);
        itself, as written, where that is its own."""
        form = self.decoder.form_under(role)
        return self if form == self.name else CodecSpec.read(form)

    def __str__(self) -> str:
        return self.text


CodecSpec.NONE = CodecSpec(text="none", name="none", family="none", lossless=True, decoder=IdentityCodec())


def parse_region_codecs(text: str) -> dict[str, CodecSpec]:
    """``"eu=bf16,us=topk:0.01"`` -> ``{"eu": bf16, "us": topk:0.01}`` (per-region uplink codecs).

    Raises:
        ConfigError: malformed entry or codec spec (key ``region_codecs``).
    """
    out: dict[str, CodecSpec] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        region, sep, spec = entry.partition("=")
        if not sep or not region.strip() or not spec.strip():
            raise ConfigError("region_codecs", f"expected REGION=CODEC, got {entry!r}")
        out[region.strip()] = CodecSpec.parse(spec.strip(), key="region_codecs")
    return out
