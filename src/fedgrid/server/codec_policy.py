"""Which uplink codec each client link uses.

A policy has a default codec spec and per-region overrides (``eu=bf16,us=topk:0.01``: for
example a LAN region lossless-ish and WAN regions sparse with error feedback). A client gets
its region's codec if it advertised that codec's family at join, and ``none`` otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from fedgrid.compression import parse_codec_spec
from fedgrid.compression.feedback import FeedbackRule
from fedgrid.compression.registry import parse_region_codecs
from fedgrid.config_compression import feedback_task_config
from fedgrid.plugins import is_custom_strategy
from fedgrid.types import ClientInfo

if TYPE_CHECKING:
    from fedgrid.config import Config

__all__ = ["CodecPolicy", "parse_region_codecs", "codec_family", "build_codec_policy", "uplink_form"]

log = logging.getLogger(__name__)


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


def uplink_form(spec: str, config: "Config") -> str:
    """The spec the clients send ``spec`` as: with ``error_feedback = "auto"``, under a built-in
    strategy and without SecAgg+, the codec's ``form_under(strategy)`` (``sparseloco`` under
    FedAvg is ``sparseloco:K:scaled``); ``spec`` itself otherwise. A change is logged."""
    if config.error_feedback != "auto" or config.secagg or is_custom_strategy(config.strategy):
        return spec
    built = parse_codec_spec(spec)
    form = built.form_under(config.strategy)
    if form == built.name:  # its own form: the spec as written (``topk`` stays ``topk``)
        return spec
    log.info(
        "codec %s is sent as %s under %s, the form of it that learns there (name it to choose)",
        spec,
        form,
        config.strategy,
    )
    return form


def build_codec_policy(config: "Config") -> CodecPolicy:
    """The uplink policy of a run's configuration (``codec``, ``region_codecs``), each spec in
    the form that learns under the run's strategy (``uplink_form``)."""
    return CodecPolicy(
        default=uplink_form(config.codec, config),
        by_region={
            region: uplink_form(spec, config)
            for region, spec in parse_region_codecs(config.region_codecs).items()
        },
        error_feedback=config.error_feedback,
        feedback_reset_rounds=config.feedback_reset_rounds,
    )
