"""The keys of the uplink's error feedback, a group that ``fedgrid.config.Config`` inherits
(``fedgrid.config_values.key``); ``check_compression`` validates them. The run's codecs, parsed
once from its configuration (``RunCodecs``, ``Config.codecs``), and what a task's config carries
of them (``uplink_task_config``; a client reads it back with ``task_uplink_codec``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from fedgrid.compression.spec import CodecSpec, parse_region_codecs
from fedgrid.config_values import key as _key

__all__ = [
    "CompressionKeys",
    "RunCodecs",
    "UPLINK_CODEC_KEY",
    "check_compression",
    "feedback_task_config",
    "run_codecs",
    "task_uplink_codec",
    "uplink_task_config",
]

#: The task config entry that names a fit task's uplink codec (absent: ``none``).
UPLINK_CODEC_KEY = "uplink_codec"


@dataclass(frozen=True)
class CompressionKeys:
    """Error feedback of the lossy uplink codecs (``fedgrid.compression.feedback.FeedbackRule``)."""

    error_feedback: str = _key(
        "uplink error feedback of lossy codecs: classic (e <- v - C(v), v = x + e), momentum:BETA "
        "(DeMo/SparseLoCo's, v = BETA e + x, BETA in (0, 1); a residual also decays by BETA per round "
        "its client sat out), none (no residual), or auto (the codec's own: none for randk:F:unbiased, "
        "momentum:0.5 for topk, classic for the others)",
        "auto",
    )
    feedback_reset_rounds: int = _key(
        "uplink error feedback: a client that sat out at least this many rounds drops its residual "
        "(stale under partial participation); 0 keeps it",
        0,
    )


def check_compression(config: Any) -> None:
    """Raises ``ConfigError`` naming ``error_feedback`` or ``feedback_reset_rounds`` for a bad value."""
    from fedgrid.compression.feedback import FeedbackRule

    FeedbackRule.parse(config.error_feedback, config.feedback_reset_rounds)


@dataclass(frozen=True)
class RunCodecs:
    """The codecs of a run's configuration, each parsed once (``run_codecs``).

    Attributes:
        uplink: ``codec``, the clients' uplink as written (``fedgrid.fleet.codec_policy`` picks
            the form each client is sent).
        by_region: ``region_codecs``, the uplink of the clients of each region named.
        downlink: ``downlink_codec``.
        lan: ``lan_codec``, the uplink inside a simulated region (``hierarchy``).
    """

    uplink: CodecSpec
    by_region: Mapping[str, CodecSpec]
    downlink: CodecSpec
    lan: CodecSpec


def run_codecs(config: Any) -> RunCodecs:
    """The codecs of ``config`` (read them as ``Config.codecs``, which parses them once).

    Raises:
        ConfigError: a spec that does not parse, naming its key.
    """
    return RunCodecs(
        uplink=CodecSpec.parse(config.codec, key="codec"),
        downlink=CodecSpec.parse(config.downlink_codec, key="downlink_codec"),
        by_region=parse_region_codecs(config.region_codecs),
        lan=CodecSpec.parse(config.lan_codec, key="lan_codec"),
    )


def uplink_task_config(codec: CodecSpec, error_feedback: str, reset_rounds: int) -> dict[str, Any]:
    """What a fit task's config carries of its uplink: the codec's spec as written, and the
    error-feedback rule (``feedback_task_config``)."""
    return {UPLINK_CODEC_KEY: codec.text, **feedback_task_config(error_feedback, reset_rounds)}


def task_uplink_codec(task_config: Mapping[str, Any]) -> CodecSpec:
    """The uplink codec a task received over the wire asks for (``none`` where it names none).

    Raises:
        InvalidUpdateError: the spec does not parse.
    """
    return CodecSpec.read(str(task_config.get(UPLINK_CODEC_KEY, CodecSpec.NONE.text)))


def feedback_task_config(error_feedback: str, reset_rounds: int) -> dict[str, Any]:
    """What a task's config carries of the rule (nothing for the defaults, so tasks stay as they were)."""
    out: dict[str, Any] = {}
    if error_feedback != "auto":
        out["uplink_feedback"] = error_feedback
    if reset_rounds:
        out["uplink_feedback_reset"] = reset_rounds
    return out
