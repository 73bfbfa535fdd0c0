"""Error feedback on both links: ``ErrorFeedback`` on the client's uplink, ``ShadowModel`` on the downlink.

Uplink, error feedback (EF-SGD: Seide et al. 2014; Karimireddy et al. 2019): per tensor the
client keeps a residual ``e`` (zero at first) and, for each input ``x``,

    v = beta e + x;   send C(v);   e <- v - D(C(v))

where ``D(C(v))`` is exactly what the receiver decodes. ``FeedbackRule`` chooses ``beta``, or
no residual at all (``none``: send ``C(x)``, for unbiased codecs), or the codec's own choice
(``auto``, the config's default: ``Codec.auto_feedback``);
``classic`` is 1 (plain EF); ``momentum:BETA`` (0 < BETA < 1) is the error feedback with
momentum of DeMo and SparseLoCo (Peng et al. 2024; Sarfi et al. 2025), whose buffer is the
residual decayed by ``BETA`` at every step, so what a codec held back long ago fades. Under
partial participation a residual goes stale while its client sits out; the rule's stated
treatment, applied when a client encodes again after sitting out ``R`` rounds: the residual
is multiplied by ``beta ** R`` (one decay per missed round; none for ``classic``), and
dropped when ``R >= reset_rounds`` (when that is above 0). The residual stays bounded for a
contractive codec: ``E||e|| <= sqrt(1 - d) (beta E||e|| + ||x||)``, so
``E||e|| <= sqrt(1 - d) max||x|| / (1 - beta sqrt(1 - d))``. Summed over rounds, what was
transmitted (under ``classic``) equals what was input minus the current residual, and for a contractive codec
(``topk``, ``randk``, ``sign``, ``int8``, ``fp16``, ``bf16``, ``powersgd``, ``qsgd`` with at
least 23 levels) the residual stays bounded. Both classes refuse a codec that is not
contractive (``qsgd`` with few levels: unbiased, but its variance exceeds the signal). The residual
is float32 (float64 for float64 tensors) whatever the tensor's dtype, so a bf16 model loses
nothing to its own rounding; integer and bool tensors are sent losslessly and have none.

Downlink, the same idea on the server: the coordinator keeps one shadow copy ``s`` of the
model its clients hold, and each round sends ``C(g - s)`` for the new global model ``g`` and
sets ``s <- s + D(C(g - s))``, running ``apply_delta``, the very function clients run, so
every client that applied the same updates holds ``s`` bit for bit. ``g - s`` is the
residual carried into the next round; memory is one model whatever the number of clients. A
client that missed a round, or is new, gets ``catch_up()``: the whole shadow, lossless.

Both are pure: tensors in, tensors and bytes out; no I/O, no logging.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import torch

from fedgrid.compression.base import LOSSY_DTYPES, Codec, IdentityCodec
from fedgrid.compression.spec import CodecSpec
from fedgrid.errors import ConfigError, InvalidUpdateError
from fedgrid.seeding import RNG_LOCK

__all__ = [
    "FeedbackRule",
    "Transmitted",
    "ErrorFeedback",
    "DownlinkUpdate",
    "ShadowModel",
    "apply_delta",
    "apply_downlink",
    "is_delta_tensor",
    "reconstruct",
]


_KINDS = ("ef", "none", "auto")


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype is torch.float64 else torch.float32


def _codec(codec: Codec | CodecSpec, key: str, *, contractive: bool = True) -> Codec:
    built = codec.build() if isinstance(codec, CodecSpec) else codec
    if contractive and not built.contractive:
        raise ConfigError(
            key,
            f"codec '{built.name}' is not contractive, so an error-feedback residual would grow without "
            "bound (qsgd needs at least 23 levels under error feedback; an unbiased codec runs with "
            "error_feedback 'none' or 'auto')",
        )
    return built


@dataclass(frozen=True)
class FeedbackRule:
    """How the uplink's error feedback carries a residual: its decay ``beta`` per step and per
    round sat out, and after how many rounds sat out it is dropped (0: never).

    ``kind``: ``ef`` keeps a residual (classic, or with momentum); ``none`` keeps none (sends
    ``C(x)``: for unbiased codecs, whose error averages out over clients); ``auto`` is the
    codec's ``auto_feedback`` (``for_codec``). ``parse`` reads the config's ``error_feedback``
    and ``feedback_reset_rounds``; the class's defaults are classic EF, never reset.
    """

    beta: float = 1.0
    reset_rounds: int = 0
    kind: str = "ef"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.beta) and 0.0 < self.beta <= 1.0):
            raise ValueError(f"the error-feedback decay must be in (0, 1], got {self.beta}")
        if self.reset_rounds < 0:
            raise ValueError(f"feedback_reset_rounds must be at least 0, got {self.reset_rounds}")
        if self.kind not in _KINDS:
            raise ValueError(f"the error-feedback kind is one of {_KINDS}, got {self.kind!r}")

    @classmethod
    def parse(cls, spec: str, reset_rounds: int = 0) -> "FeedbackRule":
        """``auto``, ``classic``, ``momentum:BETA`` or ``none``.

        Raises:
            ConfigError: another spec, or a BETA outside (0, 1) (key ``error_feedback``), or a
                negative ``reset_rounds`` (key ``feedback_reset_rounds``).
        """
        if reset_rounds < 0:
            raise ConfigError("feedback_reset_rounds", f"must be at least 0, got {reset_rounds}")
        if spec in ("auto", "none"):
            return cls(1.0, reset_rounds, spec)
        if spec == "classic":
            return cls(1.0, reset_rounds)
        match = re.fullmatch(r"momentum:([0-9]*\.?[0-9]+)", spec)
        beta = float(match.group(1)) if match else math.nan
        if not 0.0 < beta < 1.0:
            raise ConfigError(
                "error_feedback",
                f"expected 'auto', 'classic', 'momentum:BETA' with BETA in (0, 1), or 'none', got {spec!r}",
            )
        return cls(beta, reset_rounds)

    @property
    def spec(self) -> str:
        """The ``error_feedback`` text of this rule (``auto``, ``classic``, ``momentum:0.95``, ``none``)."""
        if self.kind != "ef":
            return self.kind
        return "classic" if self.beta == 1.0 else f"momentum:{self.beta!r}"

    def for_codec(self, codec: Codec) -> "FeedbackRule":
        """This rule with ``auto`` resolved to ``codec.auto_feedback`` (same ``reset_rounds``)."""
        if self.kind != "auto":
            return self
        return FeedbackRule.parse(codec.auto_feedback, self.reset_rounds)

    def carry(self, rounds_out: int) -> float:
        """The factor on a residual whose client sat out ``rounds_out`` rounds (0: dropped)."""
        if rounds_out <= 0:
            return 1.0
        if self.reset_rounds and rounds_out >= self.reset_rounds:
            return 0.0
        return self.beta**rounds_out


@dataclass(frozen=True)
class Transmitted:
    """One encoded tensor: the bytes to send and what the receiver will decode from them.

    Attributes:
        payload: the codec's payload; ``len(payload)`` is the encoded size.
        decoded: ``codec.decode(payload)``, a CPU tensor of the input's dtype and shape.
    """

    payload: bytes
    decoded: torch.Tensor


class ErrorFeedback:
    """Client-side error feedback (classic, or with momentum: ``rule``) around any codec.

    Args:
        codec: a spec (a fresh instance is built, so ``powersgd`` warm starts per client) or
            a codec the caller owns.
        rule: the residual's decay and staleness rule (default: classic EF, never reset);
            ``auto`` is resolved for ``codec`` (``FeedbackRule.for_codec``).
        repeatable: keep what the latest round began from, so that the same round encodes
            again as it did the first time (``begin_round``); ``False`` for a sender that is
            never handed a round twice (a simulated client), which saves one residual.

    Raises:
        ConfigError: ``codec`` is not contractive while the rule keeps a residual (also when
            ``rule`` is set later).
    """

    def __init__(
        self, codec: Codec | CodecSpec, rule: FeedbackRule | None = None, *, repeatable: bool = True
    ) -> None:
        self.codec = _codec(codec, "codec", contractive=False)
        self.repeatable = repeatable
        self._rule = FeedbackRule(kind="none")
        self.rule = rule or FeedbackRule()
        self._residuals: dict[str, torch.Tensor] = {}
        #: The last round ``begin_round`` saw (``None``: none yet).
        self.last_round: int | None = None
        # What the last round began from: its last_round, residuals and codec state (``begin_round``).
        self._round_start: tuple[int | None, dict[str, torch.Tensor], dict[str, Any]] | None = None

    @property
    def rule(self) -> FeedbackRule:
        """The rule in force (``auto`` already resolved for this codec)."""
        return self._rule

    @rule.setter
    def rule(self, rule: FeedbackRule) -> None:
        resolved = rule.for_codec(self.codec)
        _codec(self.codec, "codec", contractive=resolved.kind == "ef")
        self._rule = resolved

    def begin_round(self, server_round: int) -> float:
        """Applies the rule to every residual before the uploads of ``server_round``: a client
        that last encoded in round ``q`` sat out ``server_round - q - 1`` rounds. Returns the
        factor applied (1 when it took part in the previous round, 0 when the residuals were
        dropped).

        The same round again (its task handed again: a coordinator or region restarted before
        the round counted the first upload) starts from what the round began from the first
        time, so the update is encoded as it was then and the residual moves on once: an
        encoding is not idempotent, and a residual that took a round's update twice sends
        another model. To that end the residuals the latest round began from are kept (with
        ``encode`` replacing, never changing, a residual tensor, they are the previous round's
        tensors: one more residual in memory and in ``state_dict``)."""
        if self.last_round is not None and server_round == self.last_round and self._round_start is not None:
            self.last_round, residuals, codec_state = self._round_start
            self._residuals = dict(residuals)
            self.codec.load_state_dict(codec_state)
        if self.repeatable and (self.last_round is None or server_round > self.last_round):
            self._round_start = (self.last_round, dict(self._residuals), self.codec.state_dict())
        factor = 1.0
        if self.last_round is not None and server_round > self.last_round:
            factor = self.rule.carry(server_round - self.last_round - 1)
            if factor == 0.0:
                self._residuals.clear()
            elif factor != 1.0:
                self._residuals = {k: v * factor for k, v in self._residuals.items()}
        self.last_round = server_round if self.last_round is None else max(self.last_round, server_round)
        return factor

    def encode(
        self, name: str, tensor: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> Transmitted:
        """Encodes ``tensor + residual[name]`` and keeps what the codec dropped as the new residual.

        Raises:
            ValueError: ``tensor`` has another shape than the residual kept under ``name``.
            InvalidUpdateError: the tensor holds NaN or Inf (lossy codecs refuse it).
        """
        dtype, shape = tensor.dtype, tuple(tensor.shape)
        if dtype not in LOSSY_DTYPES or self.codec.lossless or self.rule.kind == "none":
            self._residuals.pop(name, None)
            payload = bytes(self.codec.encode(tensor, generator=generator, key=name))
            return Transmitted(payload, self.codec.decode(payload, dtype=dtype, shape=shape))
        acc = tensor.detach().to(_work_dtype(dtype))
        residual = self._residuals.get(name)
        if residual is not None:
            if tuple(residual.shape) != shape:
                raise ValueError(f"tensor '{name}' is {list(shape)}, its residual {list(residual.shape)}")
            residual = residual.to(acc.device)
            acc = acc + (residual if self.rule.beta == 1.0 else self.rule.beta * residual)
        payload = bytes(self.codec.encode(acc.to(dtype), generator=generator, key=name))
        decoded = self.codec.decode(payload, dtype=dtype, shape=shape)
        self._residuals[name] = acc - decoded.to(acc.device, acc.dtype)
        return Transmitted(payload, decoded)

    def encode_state(
        self, state: Mapping[str, torch.Tensor], *, generator: torch.Generator | None = None
    ) -> "OrderedDict[str, Transmitted]":
        """``encode`` for every tensor of ``state``, in its order."""
        return OrderedDict((name, self.encode(name, t, generator=generator)) for name, t in state.items())

    @property
    def residuals(self) -> Mapping[str, torch.Tensor]:
        """The current residual per tensor name (read-only view)."""
        return MappingProxyType(self._residuals)

    def reset(self) -> None:
        """Drops every residual (e.g. when the model is replaced)."""
        self._residuals.clear()
        self._round_start = None

    def state_dict(self) -> dict[str, Any]:
        """Residuals, the last round and codec state, on CPU, to save with the client's state;
        ``round_start``: what the last round began from (``begin_round``)."""
        start = self._round_start
        return {
            "codec": self.codec.name,
            "last_round": self.last_round,
            "residuals": _on_cpu(self._residuals),
            "codec_state": self.codec.state_dict(),
            "round_start": None
            if start is None
            else {"last_round": start[0], "residuals": _on_cpu(start[1]), "codec_state": start[2]},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores ``state_dict()``.

        Raises:
            ValueError: the state was saved with another codec.
        """
        if state.get("codec") != self.codec.name:
            raise ValueError(
                f"error-feedback state is for codec {state.get('codec')!r}, this one uses {self.codec.name!r}"
            )
        self._residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self.last_round = state.get("last_round")
        self.codec.load_state_dict(state.get("codec_state", {}))
        start = state.get("round_start")  # absent from a state saved before it was kept
        self._round_start = (
            None
            if start is None
            else (
                start["last_round"],
                {k: v.clone() for k, v in start["residuals"].items()},
                dict(start["codec_state"]),
            )
        )


def _on_cpu(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").clone() for k, v in tensors.items()}


# -- downlink ------------------------------------------------------------------------------
@dataclass(frozen=True)
class DownlinkUpdate:
    """What moves a client's copy of the model from ``base_version`` to ``version``.

    Attributes:
        version: the shadow version a client holds after applying this.
        base_version: the version it applies to; ``None`` for a full model (catch-up), which
            replaces whatever the client holds.
        codec: codec of the float tensors' deltas.
        value_codec: codec of whole values: every tensor of a full model, and the integer and
            bool tensors of a delta update (sent as new values, not differences).
        payloads: one payload per tensor name.
    """

    version: int
    base_version: int | None
    codec: CodecSpec
    payloads: Mapping[str, bytes] = field(default_factory=dict)
    value_codec: CodecSpec = CodecSpec.NONE

    @property
    def is_full(self) -> bool:
        return self.base_version is None

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.payloads.values())

    def codec_for(self, dtype: torch.dtype) -> CodecSpec:
        """The codec a tensor of ``dtype`` travels with (its ``TensorMeta.codec`` on the wire)."""
        return self.codec if not self.is_full and dtype in LOSSY_DTYPES else self.value_codec


def apply_delta(
    held: Mapping[str, torch.Tensor], decoded: Mapping[str, torch.Tensor]
) -> "OrderedDict[str, torch.Tensor]":
    """The model after a delta update: ``held + decoded`` for float tensors, ``decoded`` for the rest.

    Clients and ``ShadowModel`` both run this, so they compute the same bits. New tensors
    are returned; ``held`` is not modified.

    Raises:
        InvalidUpdateError: names, dtypes or shapes differ.
    """
    _check_specs(held, decoded)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, t in held.items():
        d = decoded[name].to(t.device)
        out[name] = t + d if t.dtype in LOSSY_DTYPES else d.clone()
    return out


def is_delta_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` travels as a difference to the global model on the uplink (float
    tensors; integer and bool tensors such as step counters always travel whole)."""
    return tensor.dtype.is_floating_point


def reconstruct(
    global_state: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor], *, delta: bool
) -> "OrderedDict[str, torch.Tensor]":
    """The coordinator's half of the uplink: the client's model from what it sent (``received``
    may be part of the model, e.g. one streaming fragment)."""
    if not delta:
        return OrderedDict(received)
    return OrderedDict(
        (name, global_state[name] + value if is_delta_tensor(value) else value)
        for name, value in received.items()
    )


def apply_downlink(
    held: Mapping[str, torch.Tensor], update: DownlinkUpdate, *, held_version: int | None = None
) -> "OrderedDict[str, torch.Tensor]":
    """Decodes ``update`` and applies it to ``held`` (a client's copy, or any model of the same specs).

    Args:
        held: the client's tensors; for a full update only their dtypes and shapes matter.
        update: from ``ShadowModel.sync`` or ``ShadowModel.catch_up``.
        held_version: the version ``held`` is at, checked against ``update.base_version``.

    Raises:
        InvalidUpdateError: a payload is malformed, a tensor is missing or extra, or a delta
            update is for another version than ``held_version`` (the client needs a catch-up).
    """
    if not update.is_full and held_version is not None and held_version != update.base_version:
        raise InvalidUpdateError(
            f"update applies to version {update.base_version}, client holds {held_version}: needs a catch-up"
        )
    missing = [n for n in held if n not in update.payloads]
    extra = [n for n in update.payloads if n not in held]
    if missing or extra:
        raise InvalidUpdateError(f"downlink update: missing tensors {missing[:5]}, unexpected {extra[:5]}")
    decoded: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, t in held.items():
        codec = update.codec_for(t.dtype).decoder
        try:
            decoded[name] = codec.decode(update.payloads[name], dtype=t.dtype, shape=tuple(t.shape))
        except InvalidUpdateError as exc:
            raise InvalidUpdateError(f"tensor '{name}': {exc}") from None
    if update.is_full:
        return OrderedDict((name, d.to(held[name].device)) for name, d in decoded.items())
    return apply_delta(held, decoded)


def _check_specs(reference: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor]) -> None:
    if set(reference) != set(other):
        raise InvalidUpdateError(f"tensor names differ: {sorted(set(reference) ^ set(other))[:5]}")
    for name, t in reference.items():
        o = other[name]
        if o.dtype != t.dtype or o.shape != t.shape:
            raise InvalidUpdateError(
                f"tensor '{name}': {o.dtype} {list(o.shape)}, expected {t.dtype} {list(t.shape)}"
            )


class ShadowModel:
    """Server-side downlink error feedback: one shadow of the model clients hold.

    Args:
        initial: the model every client starts from (sent to them losslessly); copied.
        codec: spec or codec of the deltas; it must be registered, since clients decode
            with the codec its name reads as (``CodecSpec.read``). A spec gets a fresh instance
            (its own warm start).
        catch_up_codec: a lossless codec for full models (``none`` or ``none+zstd``).

    Raises:
        ConfigError: ``codec`` is not contractive.
        ValueError: ``catch_up_codec`` is lossy.
    """

    def __init__(
        self,
        initial: Mapping[str, torch.Tensor],
        *,
        codec: Codec | CodecSpec,
        catch_up_codec: CodecSpec = CodecSpec.NONE,
    ) -> None:
        self.codec = _codec(codec, "downlink_codec")
        self._spec = CodecSpec.of(self.codec)
        if not catch_up_codec.lossless:
            raise ValueError(f"catch-up codec must be lossless, {catch_up_codec.text!r} is not")
        self._catch_up = catch_up_codec
        self._shadow: OrderedDict[str, torch.Tensor] = OrderedDict(
            (k, v.detach().clone()) for k, v in initial.items()
        )
        self.version = 0

    @property
    def shadow(self) -> Mapping[str, torch.Tensor]:
        """What every up-to-date client holds (read-only view; do not modify the tensors)."""
        return MappingProxyType(self._shadow)

    def sync(
        self, global_state: Mapping[str, torch.Tensor], *, generator: torch.Generator | None = None
    ) -> tuple[DownlinkUpdate, Mapping[str, torch.Tensor]]:
        """Encodes ``global_state - shadow``, advances the shadow by exactly what was encoded.

        Returns:
            The update for clients at ``version - 1`` and the new shadow.

        Raises:
            InvalidUpdateError: ``global_state`` has other names, dtypes or shapes, or holds NaN/Inf.
        """
        _check_specs(self._shadow, global_state)
        payloads: dict[str, bytes] = {}
        # Torch's default generator is the process's: not while a client trains in this one (simulation).
        with RNG_LOCK if self.codec.stochastic and generator is None else contextlib.nullcontext():
            for name, s in self._shadow.items():
                g = global_state[name].detach().to(s.device)
                if s.dtype in LOSSY_DTYPES:
                    work = _work_dtype(s.dtype)
                    delta = (g.to(work) - s.to(work)).to(s.dtype)
                    payloads[name] = bytes(self.codec.encode(delta, generator=generator, key=name))
                else:
                    payloads[name] = bytes(IdentityCodec().encode(g))
        update = DownlinkUpdate(
            version=self.version + 1, base_version=self.version, codec=self._spec, payloads=payloads
        )
        self._shadow = apply_downlink(self._shadow, update)
        self.version += 1
        return update, self.shadow

    def catch_up(self) -> DownlinkUpdate:
        """The whole shadow, lossless, for a client that is new or missed a round (cache it per version)."""
        payloads = {name: bytes(self._catch_up.decoder.encode(t)) for name, t in self._shadow.items()}
        return DownlinkUpdate(
            version=self.version,
            base_version=None,
            codec=self._catch_up,
            payloads=payloads,
            value_codec=self._catch_up,
        )

    def gap(self, global_state: Mapping[str, torch.Tensor]) -> "OrderedDict[str, torch.Tensor]":
        """``global_state - shadow`` per float tensor: the residual the next sync carries."""
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        for name, s in self._shadow.items():
            if s.dtype in LOSSY_DTYPES:
                work = _work_dtype(s.dtype)
                out[name] = global_state[name].detach().to(s.device, work) - s.to(work)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Version, shadow and codec state, on CPU, for the coordinator's durable state."""
        return {
            "version": self.version,
            "codec": self.codec.name,
            "shadow": OrderedDict((k, v.to("cpu").clone()) for k, v in self._shadow.items()),
            "codec_state": self.codec.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores ``state_dict()``.

        Raises:
            ValueError: the state was saved with another codec.
        """
        if state.get("codec") != self.codec.name:
            raise ValueError(
                f"shadow state is for codec {state.get('codec')!r}, this one uses {self.codec.name!r}"
            )
        self._shadow = OrderedDict((k, v.clone()) for k, v in state["shadow"].items())
        self.version = int(state["version"])
        self.codec.load_state_dict(state.get("codec_state", {}))
