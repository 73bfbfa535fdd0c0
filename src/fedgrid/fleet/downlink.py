"""Downlink compression, the coordinator's half: what each client downloads in a round.

With the ``none`` codec every client downloads the global model, whole and exact. With a
lossy codec the coordinator keeps one shadow of the model its clients hold
(``compression.feedback.ShadowModel``: server-side error feedback, memory one model whatever
the number of clients). Each round it sends the compressed difference between the new
global model and the shadow to clients holding the previous version, and the whole shadow,
lossless, to clients that are new or missed a round. Clients train from the shadow, so
uploads that carry differences are reconstructed against it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from fedgrid.compression.feedback import DownlinkUpdate, ShadowModel
from fedgrid.compression.spec import CodecSpec
from fedgrid.proto.serde import EncodedModel
from fedgrid.types import ModelState

__all__ = ["Downlink", "RoundDownlink"]


def _encoded(update: DownlinkUpdate, like: Mapping[str, torch.Tensor]) -> EncodedModel:
    return EncodedModel.from_payloads(
        (name, t.dtype, tuple(t.shape), update.codec_for(t.dtype).name, update.payloads[name])
        for name, t in like.items()
    )


@dataclass
class RoundDownlink:
    """One round's downloads.

    Attributes:
        base: the model clients hold after this round's download (the shadow, or the
            global model on an uncompressed link): what difference uploads apply to.
        version: the version a client reaches, as on the wire: the shadow's version plus
            one, so that 0 means "none" (uncompressed links).
        offset: on a compressed link, ``base - global`` for each lossy floating tensor (in
            its work dtype): what turns a difference from ``base`` into one from the round's
            model; ``None`` on an uncompressed link.
    """

    base: ModelState
    version: int
    offset: ModelState | None = None
    _full: EncodedModel | None = None
    _delta: EncodedModel | None = None
    _base_version: int = 0
    _shadow: ShadowModel | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def exact(self) -> bool:
        """Clients hold exactly the round's model (an uncompressed link): a difference a client
        sends is then a difference from the model the fleet was given."""
        return self.version == 0

    def for_client(self, have_version: int | None) -> tuple[EncodedModel, bool, int]:
        """(what to send, whether it is a difference, the version it applies to)."""
        if self._delta is not None and have_version is not None and have_version == self._base_version:
            return self._delta, True, self._base_version
        with self._lock:  # built once per round, on the first client that needs it
            if self._full is None:
                assert self._shadow is not None
                self._full = _encoded(self._shadow.catch_up(), self.base)
        return self._full, False, 0


class Downlink:
    """The coordinator's downlink for a run.

    Args:
        codec: ``none`` or a lossy spec (``int8``, ``topk:0.05``, ...).

    Raises:
        ConfigError: the codec is not contractive.
    """

    def __init__(self, codec: CodecSpec = CodecSpec.NONE) -> None:
        self.codec = codec
        self.lossless = codec.lossless
        self.shadow: ShadowModel | None = None

    def prepare(self, global_state: ModelState) -> RoundDownlink:
        """The downloads of a round whose global model is ``global_state``."""
        if self.lossless:
            return RoundDownlink(
                base=global_state, version=0, _full=EncodedModel(global_state, codec=self.codec)
            )
        if self.shadow is None:  # first round: everyone starts from the exact model
            self.shadow = ShadowModel(global_state, codec=self.codec)
            return RoundDownlink(
                base=OrderedDict(self.shadow.shadow),
                version=self.shadow.version + 1,
                offset=self._offset(global_state),
                _shadow=self.shadow,
            )
        update, shadow = self.shadow.sync(global_state)
        assert update.base_version is not None
        return RoundDownlink(
            base=OrderedDict(shadow),
            version=update.version + 1,
            offset=self._offset(global_state),
            _delta=_encoded(update, shadow),
            _base_version=update.base_version + 1,
            _shadow=self.shadow,
        )

    def _offset(self, global_state: ModelState) -> ModelState:
        """``shadow - global_state`` per lossy floating tensor (``RoundDownlink.offset``)."""
        assert self.shadow is not None
        return OrderedDict((name, gap.neg_()) for name, gap in self.shadow.gap(global_state).items())

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.codec.text, "shadow": None if self.shadow is None else self.shadow.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("shadow") is not None:
            self.shadow = ShadowModel(state["shadow"]["shadow"], codec=self.codec)
            self.shadow.load_state_dict(state["shadow"])
