"""Uplink compression, both halves: the client encodes its update as the difference to the
global model it trained from, through a codec with error feedback; the coordinator adds the
decoded difference back. Simulation and deployment run this same code, so they end with the
same bits whatever the codec.

Floating-point tensors travel as differences (what lossy codecs are meant for, and what
error feedback accumulates); integer and bool tensors (e.g. BatchNorm's step counters)
always travel whole. With the ``none`` codec the update travels whole and bit-exact.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from fedgrid.compression.feedback import ErrorFeedback, FeedbackRule, is_delta_tensor, reconstruct
from fedgrid.compression.spec import CodecSpec
from fedgrid.proto.serde import EncodedModel
from fedgrid.seeding import derive_seed

__all__ = [
    "UplinkEncoder",
    "feedback_rule",
    "is_delta_tensor",
    "reconstruct",
]  # the last two live in fedgrid.compression.feedback (the coordinator needs them too)


def feedback_rule(task_config: Mapping[str, Any]) -> FeedbackRule:
    """The error-feedback rule a task asks for (``uplink_feedback``, ``uplink_feedback_reset``;
    ``fedgrid.config_compression.feedback_task_config`` writes them; absent: ``auto``).

    Raises:
        ConfigError: a value that is not a rule, naming the config key.
    """
    reset = task_config.get("uplink_feedback_reset", 0)
    whole = isinstance(reset, (int, float)) and not isinstance(reset, bool) and float(reset).is_integer()
    return FeedbackRule.parse(str(task_config.get("uplink_feedback", "auto")), int(reset) if whole else -1)


class UplinkEncoder:
    """The client's half for one codec; keeps the error-feedback residual across rounds.

    Args:
        codec: the task's uplink codec (``none``, ``int8``, ``topk:0.01``, ...).
        repeatable: ``ErrorFeedback``'s: a deployed client may be handed a round again after a
            restart; a simulated one never is (``False`` saves one residual).

    Raises:
        ConfigError: (lossy codecs) the codec is not contractive and not unbiased (``auto``
            runs an unbiased codec without error feedback).
    """

    def __init__(self, codec: CodecSpec, *, repeatable: bool = True) -> None:
        self.spec = codec
        self.lossless = codec.lossless
        self.feedback = (
            None if self.lossless else ErrorFeedback(codec, FeedbackRule(kind="auto"), repeatable=repeatable)
        )
        self._seed = 0

    def begin(self, server_round: int, task_config: Mapping[str, Any], client: str = "") -> "UplinkEncoder":
        """Takes the task's error-feedback rule and applies its staleness rule before this
        round's upload (``ErrorFeedback.begin_round``); returns ``self``. Deployed clients and the
        simulation both call it before ``encode``, so their residuals stay bit-identical.

        A stochastic codec (``randk``, ``qsgd``) draws from a generator of its own, seeded from
        the task's seed, the round and ``client`` (the client's name): a rerun, and a deployment
        and its simulation, draw the same numbers whatever else the process drew before."""
        self._seed = derive_seed(task_config.get("seed", 0), server_round, client, "uplink")
        if self.feedback is not None:
            self.feedback.rule = feedback_rule(task_config)
            self.feedback.begin_round(server_round)
        return self

    def encode(
        self, *, global_state: Mapping[str, torch.Tensor], new_state: Mapping[str, torch.Tensor]
    ) -> tuple[EncodedModel, bool]:
        """Returns the encoded update and whether it carries differences."""
        if self.feedback is None:
            return EncodedModel(new_state, codec=self.spec, lazy=True), False
        items = []
        # Never torch's default generator: a trainer may draw from it meanwhile (overlapped
        # DiLoCo trains while its upload is encoded), and its state depends on the process.
        generator = torch.Generator().manual_seed(self._seed) if self.feedback.codec.stochastic else None
        for name, tensor in new_state.items():
            # A tensor the model lacks (SCAFFOLD's ``scaffold.c_delta.*``) has nothing to differ from: sent as it is.
            ref = global_state.get(name)
            value = tensor - ref.to(tensor.device) if ref is not None and is_delta_tensor(tensor) else tensor
            sent = self.feedback.encode(name, value.detach().to("cpu"), generator=generator)
            items.append((name, tensor.dtype, tuple(tensor.shape), self.feedback.codec.name, sent.payload))
        return EncodedModel.from_payloads(items), True

    def state_dict(self) -> dict[str, Any]:
        return {
            "codec": self.spec.text,
            "feedback": None if self.feedback is None else self.feedback.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.feedback is not None and state.get("feedback") is not None:
            self.feedback.load_state_dict(state["feedback"])
