"""The keys of the uplink's error feedback, a group that ``fedgrid.config.Config`` inherits
(``fedgrid.config_values.key``); ``check_compression`` validates them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedgrid.config_values import key as _key

__all__ = ["CompressionKeys", "check_compression", "feedback_task_config"]


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


def feedback_task_config(error_feedback: str, reset_rounds: int) -> dict[str, Any]:
    """What a task's config carries of the rule (nothing for the defaults, so tasks stay as they were)."""
    out: dict[str, Any] = {}
    if error_feedback != "auto":
        out["uplink_feedback"] = error_feedback
    if reset_rounds:
        out["uplink_feedback_reset"] = reset_rounds
    return out
