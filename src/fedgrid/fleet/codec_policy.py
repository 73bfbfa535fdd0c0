"""Which uplink codec each client link uses.

A policy has a default codec spec and per-region overrides (``eu=bf16,us=topk:0.01``: for
example a LAN region lossless-ish and WAN regions sparse with error feedback). A client gets
its region's codec if it advertised that codec's family at join, and ``none`` otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from fedgrid.aggregation.by_name import strategy_role
from fedgrid.compression.feedback import FeedbackRule
from fedgrid.compression.spec import CodecSpec
from fedgrid.config_compression import uplink_task_config
from fedgrid.plugins import is_custom_strategy
from fedgrid.types import ClientInfo

if TYPE_CHECKING:
    from fedgrid.config import Config

__all__ = ["CodecPolicy", "build_codec_policy", "uplink_form"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CodecPolicy:
    """Uplink codec per client: ``default`` unless its region has an override."""

    default: CodecSpec = CodecSpec.NONE
    by_region: Mapping[str, CodecSpec] = field(default_factory=dict)
    #: The uplink's error-feedback rule (``error_feedback``, ``feedback_reset_rounds``), told in every task.
    error_feedback: str = "auto"
    feedback_reset_rounds: int = 0

    def __post_init__(self) -> None:
        FeedbackRule.parse(self.error_feedback, self.feedback_reset_rounds)

    def uplink(self, client: ClientInfo) -> CodecSpec:
        spec = self.by_region.get(client.region, self.default)
        return spec if spec.family in client.codecs or spec.family == "none" else CodecSpec.NONE

    def task_config(self, codec: CodecSpec) -> dict[str, Any]:
        """The task config entries of an uplink through ``codec`` under this policy's error feedback."""
        return uplink_task_config(codec, self.error_feedback, self.feedback_reset_rounds)


def uplink_form(spec: CodecSpec, config: "Config") -> CodecSpec:
    """The spec the clients send ``spec`` as: with ``error_feedback = "auto"``, under a built-in
    strategy and without SecAgg+, the codec's form under what the strategy declares it makes of
    the updates (``Codec.form_under(Strategy.update_role)``: ``sparseloco`` under FedAvg's model
    averaging is ``sparseloco:K:scaled``); ``spec`` itself otherwise. A change is logged."""
    if config.error_feedback != "auto" or config.secagg or is_custom_strategy(config.strategy):
        return spec
    form = spec.form_under(strategy_role(config.strategy))
    if form == spec:  # its own form: the spec as written (``topk`` stays ``topk``)
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
    codecs = config.codecs
    return CodecPolicy(
        default=uplink_form(codecs.uplink, config),
        by_region={region: uplink_form(spec, config) for region, spec in codecs.by_region.items()},
        error_feedback=config.error_feedback,
        feedback_reset_rounds=config.feedback_reset_rounds,
    )
