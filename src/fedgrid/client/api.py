"""What application code implements to take part in a federation: ``Client``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping

from fedgrid.capabilities import Capabilities, CapabilityOverride
from fedgrid.client.progress import ProgressBoard
from fedgrid.client.timeline import Timeline
from fedgrid.types import FitIns, MessageIns, ModelState, Scalar

__all__ = ["Client", "FitOutput", "EvaluateOutput"]


class OwnedState(OrderedDict):
    """A ``FitOutput.state`` whose tensors are fresh, contiguous CPU copies that the client
    keeps no reference to, so a receiver in the same process (the simulated fleet) may keep
    them as they are instead of copying them again. ``TorchClient`` uploads one (unless an
    algorithm's ``upload`` hook builds another mapping); anything else is copied."""


@dataclass(frozen=True)
class FitOutput:
    """What ``Client.fit`` returns.

    Attributes:
        state: the tensors to send back (for FedAvg, the locally trained model).
        num_examples: examples trained on; the client's weight in averaging.
        metrics: scalar metrics, e.g. ``{"loss": 0.31}``.
    """

    state: ModelState
    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EvaluateOutput:
    """What ``Client.evaluate`` returns: examples evaluated and metrics (``loss``, ``accuracy``)."""

    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)


class Client(ABC):
    """A federation member: trains on a task and evaluates the global model.

    Attributes:
        name: stable label sent at join; the coordinator orders results by it.
        region: region label sent at join.
        capability_override: capabilities stated in place of detected ones at Join, field
            by field (``fedgrid client --report-device/--report-accelerators/--report-memory``).
        timeline: where this client's compute and transfer time is recorded
            (``fedgrid.client.timeline``): the runtime records each fit and each transfer,
            a trainer that goes on computing in the background (overlapped DiLoCo) records
            that too. Made at first use.
    """

    name: str = ""
    region: str = ""
    capability_override: CapabilityOverride = CapabilityOverride()

    def capabilities(self) -> Capabilities:
        """What Join reports of this client's hardware, for capability-based selection and BCD's
        ``capacity`` schedule: detected on the client's training device (its ``device``
        attribute, as a ``TorchClient`` has; else the CPU) by
        ``fedgrid.client.capabilities.detect_capabilities``, then ``capability_override``
        applied. Override it to state everything yourself.

        Raises:
            ValueError: an override out of bounds (``fedgrid.capabilities.Capabilities``).
        """
        from fedgrid.client.capabilities import detect_capabilities  # torch.cuda: only when a client joins

        return self.capability_override.apply(detect_capabilities(getattr(self, "device", None)))

    @property
    def base_hash(self) -> str:
        """The hash of the frozen base model this client trains adapters on, shown at Join (a
        coordinator with another refuses it, and the client refuses a coordinator with another):
        its ``model``'s ``base_hash`` attribute when it has one (``--peft``:
        ``fedgrid.simulation.peft_lm.PeftLM``), else ``""``."""
        return str(getattr(getattr(self, "model", None), "base_hash", ""))

    @property
    def lora_rank(self) -> int:
        """The rank of the LoRA adapters this client trains, announced at Join (``peft_rank``: a
        coordinator of ``lora_aggregation = svd`` sends it the model at that rank): its
        ``model``'s ``spec.r`` when it has adapters (``fedgrid.simulation.peft_lm.PeftLM``), else 0."""
        model = getattr(self, "model", None)
        return int(getattr(getattr(model, "spec", None), "r", 0)) if hasattr(model, "base_hash") else 0

    @property
    def progress(self) -> ProgressBoard:
        """Where this client's running task is (``fedgrid.client.progress``): its heartbeats carry it."""
        found = self.__dict__.get("_progress")
        return found if found is not None else self.__dict__.setdefault("_progress", ProgressBoard())

    @property
    def timeline(self) -> Timeline:
        found = self.__dict__.get("_timeline")
        # setdefault is atomic: a background trainer and the runtime may ask first at once.
        return found if found is not None else self.__dict__.setdefault("_timeline", Timeline())

    @property
    def num_examples(self) -> int:
        """Training examples held (reported at join; used by selection)."""
        return 0

    @abstractmethod
    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        """Trains from the global ``state`` as ``ins`` asks and returns the result."""

    def evaluate(self, state: ModelState, config: Mapping[str, Scalar]) -> EvaluateOutput:
        """Evaluates the global ``state`` on local data. Optional."""
        raise NotImplementedError(f"{type(self).__name__} does not implement evaluate()")

    def exchange(self, ins: MessageIns) -> Mapping[str, bytes]:
        """A message phase of the round (``ins.phase``): returns the messages to send, payload
        by recipient: a peer's client id from ``ins.peers``, ``fedgrid.types.TO_ALL`` (every
        other peer) or ``fedgrid.types.TO_SERVER``. Small messages only (64 KiB each, 1 MiB in
        all by default). Optional: a client of a strategy with message phases implements it."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement exchange() for message phase {ins.phase!r}"
        )

    def receive(self, ins: MessageIns, inbox: Mapping[str, bytes]) -> None:
        """The messages relayed to this client in message phase ``ins.phase``, payload by
        sender's client id (in the order of ``ins.peers``), once every peer sent or the phase
        closed; only peers that sent appear. Default: ignores them."""

    def state_dict(self) -> dict[str, Any]:
        """What this client keeps across rounds besides the model (control variates, optimizer
        state), saved by the runtime with its ``state_path``. Optional; default: nothing."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what ``state_dict`` returned, before the first task of a resumed client. Optional."""
