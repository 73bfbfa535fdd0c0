"""The keys of secure aggregation (SecAgg+, ``fedgrid.aggregation.secagg``), a group that
``fedgrid.config.Config`` inherits (``fedgrid.config_values.key``), and their checks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedgrid.config_values import key as _key
from fedgrid.errors import ConfigError

if TYPE_CHECKING:
    from fedgrid.compression.spec import CodecSpec

__all__ = ["SecAggKeys", "SECAGG_RING_BITS", "SECAGG_CODECS", "check_secagg_keys", "secagg_ring"]

#: The ring a masked upload lives in, by uplink codec: its integers cost what the codec's do.
SECAGG_RING_BITS = {"none": 32, "fp16": 16, "bf16": 16, "int8": 8}
#: QSGD's code widths that are a ring a sum of clients fits in (its 2- and 4-bit codes are not).
_QSGD_RINGS = (8, 16)
#: The uplink codecs that compose with secagg, as an error message names them.
SECAGG_CODECS = f"{', '.join(SECAGG_RING_BITS)}, or qsgd:LEVELS with 8 to 32767 levels"
#: Strategies whose clients send whole models (a masked sum is one model's update).
_WHOLE_MODEL = ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedprox", "diloco")


@dataclass(frozen=True)
class SecAggKeys:
    """Secure aggregation: the coordinator sees only the sum of the clients' updates."""

    secagg: bool = _key(
        "SecAgg+ (Bell et al. 2020): clients mask their quantized updates so the coordinator learns only "
        "their sum; rounds add key-advert, key-share and unmask phases and survive dropouts at every step",
        False,
    )
    secagg_threshold: int = _key(
        "with secagg: shares needed to rebuild a client's secrets, and the fewest survivors a round unmasks "
        "with; more than half the neighbours (0: a majority, neighbours / 2 + 1)",
        0,
    )
    secagg_neighbours: int = _key(
        "with secagg: k, each client's neighbours in the masking graph, even (0: about 2 log2 n)", 0
    )
    secagg_clip: float = _key(
        "with secagg: each coordinate of a client's update is clipped to +-this before fixed-point "
        "quantization into the ring (the codec sets the ring: none 32 bits, fp16/bf16 16, int8 8, qsgd:LEVELS "
        "its code width, with this range as QSGD's public norm)",
        1.0,
    )


def check_secagg_keys(config: Any) -> None:
    """The secagg keys' ranges, and with ``secagg`` on, the keys it cannot run with.

    Raises:
        ConfigError: naming the key.
    """
    if config.secagg_threshold < 0:
        raise ConfigError(
            "secagg_threshold", f"must be at least 0 (0: automatic), got {config.secagg_threshold}"
        )
    k = config.secagg_neighbours
    if k < 0 or k == 2 or k % 2:
        raise ConfigError("secagg_neighbours", f"must be 0 (automatic) or an even number at least 4, got {k}")
    if not (config.secagg_clip > 0 and math.isfinite(config.secagg_clip)):
        raise ConfigError("secagg_clip", f"must be a positive finite number, got {config.secagg_clip}")
    if k and config.secagg_threshold and 2 * config.secagg_threshold <= k:
        raise ConfigError(
            "secagg_threshold",
            f"{config.secagg_threshold} is not a majority of the {k} neighbours: a coordinator could "
            "collect both shares of one client (at least secagg_neighbours / 2 + 1)",
        )
    if k and config.secagg_threshold > k:
        raise ConfigError(
            "secagg_threshold", f"{config.secagg_threshold} is more than the {k} neighbours that hold shares"
        )
    if not config.secagg:
        return
    # In a simulated hierarchy each region aggregates its clients securely (its lan_codec, its
    # region_strategy) and sends one update upstream.
    codec_key, strategy_key = ("lan_codec", "region_strategy") if config.hierarchy else ("codec", "strategy")
    secagg_ring(config.codecs.lan if config.hierarchy else config.codecs.uplink, key=codec_key)
    strategy = getattr(config, strategy_key)
    if config.region_codecs and not config.hierarchy:
        raise ConfigError("region_codecs", "secagg needs one ring for all clients: leave region_codecs empty")
    if strategy not in _WHOLE_MODEL:
        raise ConfigError(
            "secagg",
            f"runs with a {strategy_key} whose clients send whole models ({', '.join(_WHOLE_MODEL)}), "
            f"not {strategy!r}",
        )
    if (config.aggregator or "mean") != "mean":
        raise ConfigError(
            "aggregator", "secagg gives the coordinator only a sum: the aggregator must be mean"
        )
    if config.min_quorum:
        raise ConfigError("min_quorum", "secagg rounds are synchronous: leave min_quorum at 0")
    if getattr(config, "peft", "") and config.lora_aggregation == "svd":
        raise ConfigError(
            "lora_aggregation",
            "svd sums each client's product B.A, and secagg gives the coordinator only the sum of the "
            "factors: use factors or ffa with secagg (every client at the coordinator's rank)",
        )


def secagg_ring(codec: "CodecSpec", *, key: str = "codec") -> tuple[int, int]:
    """The ring of a masked upload under uplink ``codec``: ``(bits, levels)``, ``levels`` QSGD's
    per sign (``qsgd:LEVELS``, masked in the ring of its code width) or 0 (the whole ring).

    Raises:
        ConfigError: (``key``) a codec that does not compose with secagg, naming those that do.
    """
    if codec.text in SECAGG_RING_BITS:
        return SECAGG_RING_BITS[codec.text], 0
    if codec.family == "qsgd" and "+" not in codec.text:
        from fedgrid.compression.quantize import QSGDCodec

        qsgd = codec.decoder
        assert isinstance(qsgd, QSGDCodec)
        bits = qsgd.bits
        if bits in _QSGD_RINGS:
            return bits, qsgd.levels
        raise ConfigError(
            key,
            f"secagg masks {codec}'s levels in a ring of its {bits}-bit codes, too narrow for a sum of "
            f"clients: use qsgd:8 or more levels (8-bit codes), or another of {SECAGG_CODECS}",
        )
    raise ConfigError(
        key,
        f"secagg masks quantized integers in a ring, which {codec.text!r} does not send: {key} must be "
        f"one of {SECAGG_CODECS}",
    )
