"""Which uplink codec each client link uses.

A policy has a default codec spec and per-region overrides (``eu=bf16,us=topk:0.01``: for
example a LAN region lossless-ish and WAN regions sparse with error feedback). A client gets
its region's codec if it advertised that codec's family at join, and ``none`` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from fedgrid.compression import parse_codec_spec
from fedgrid.compression.feedback import FeedbackRule
from fedgrid.compression.registry import parse_region_codecs
from fedgrid.config_compression import feedback_task_config
from fedgrid.types import ClientInfo

if TYPE_CHECKING:
    from fedgrid.config import Config

__all__ = ["CodecPolicy", "parse_region_codecs", "codec_family", "build_codec_policy"]


def codec_family(spec: str) -> str:
    """``topk`` for ``topk:0.01+zstd``: the part a client's advertised list names."""
    return spec.split("+", 1)[0].split(":", 1)[0]


@dataclass(frozen=True)
class CodecPolicy:
    """Uplink codec per client: ``default`` unless its region has an override."""

    default: str = "none"
    by_region: Mapping[str, str] = field(default_factory=dict)
    #: The uplink's error-feedback rule (``error_feedback``, ``feedback_reset_rounds``), told in every task.
    error_feedback: str = "auto"
    feedback_reset_rounds: int = 0

    def __post_init__(self) -> None:
        parse_codec_spec(self.default, key="codec")
        FeedbackRule.parse(self.error_feedback, self.feedback_reset_rounds)

    def feedback_config(self) -> dict[str, Any]:
        """The task config entries of the error-feedback rule (none for the defaults)."""
        return feedback_task_config(self.error_feedback, self.feedback_reset_rounds)

    def uplink(self, client: ClientInfo) -> str:
        spec = self.by_region.get(client.region, self.default)
        return spec if codec_family(spec) in client.codecs or codec_family(spec) == "none" else "none"


def build_codec_policy(config: "Config") -> CodecPolicy:
    """The uplink policy of a run's configuration (``codec``, ``region_codecs``)."""
    return CodecPolicy(
        default=config.codec,
        by_region=parse_region_codecs(config.region_codecs),
        error_feedback=config.error_feedback,
        feedback_reset_rounds=config.feedback_reset_rounds,
    )
