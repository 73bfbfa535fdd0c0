"""Messages passed between components: frozen dataclasses, no protobuf.

A model travels as a ``ModelState``: an ordered mapping from parameter name to tensor.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping, Union

import torch

__all__ = [
    "ModelState",
    "TensorSpec",
    "Scalar",
    "ClientInfo",
    "FitIns",
    "FitRes",
    "EvaluateIns",
    "EvaluateRes",
    "Failure",
    "RoundMetrics",
    "MessageIns",
    "MessageRes",
    "FIT",
    "EVALUATE",
    "TO_SERVER",
    "TO_ALL",
    "UpdateRole",
    "check_phase_name",
]

ModelState = OrderedDict[str, torch.Tensor]
Scalar = Union[bool, int, float, str]


@dataclass(frozen=True)
class TensorSpec:
    """The dtype and shape a receiver expects of one tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of a tensor of this spec, uncompressed."""
        return math.prod(self.shape) * self.dtype.itemsize

    @staticmethod
    def of(state: Mapping[str, torch.Tensor]) -> "OrderedDict[str, TensorSpec]":
        """The specs of every tensor of ``state``, in order."""
        return OrderedDict((k, TensorSpec(v.dtype, tuple(v.shape))) for k, v in state.items())


@dataclass(frozen=True)
class ClientInfo:
    """What the coordinator knows of a client that joined.

    Attributes:
        client_id: id assigned at join.
        name: the client's own stable label; the canonical aggregation order sorts by it.
        region: free-form region label.
        num_examples: training examples the client holds.
        device: ``cpu``, ``cuda``, ...
        num_accelerators: local GPUs.
        memory_bytes: memory the client reports.
        codecs: codecs the client supports.
        lora_rank: the rank of its LoRA adapters when it differs from the coordinator's
            (``peft_rank``; 0: the coordinator's; ``fedgrid.aggregation.lora_ranks``).
    """

    client_id: str
    name: str = ""
    region: str = ""
    num_examples: int = 0
    device: str = "cpu"
    num_accelerators: int = 0
    memory_bytes: int = 0
    codecs: tuple[str, ...] = ("none",)
    lora_rank: int = 0

    @property
    def sort_key(self) -> tuple[str, str]:
        return (self.name, self.client_id)


@dataclass(frozen=True)
class FitIns:
    """A training task for one client.

    Attributes:
        round: the server round.
        config: scalars sent with the task.
        expected: the tensors the client must send back (names, dtypes, shapes); ``None``
            means exactly the global model's. Strategies whose clients send something else
            (one block of the model, extra control variates) say so here, and the fleet
            rejects any other upload.
        download: the names of the tensors of ``Strategy.downlink_state`` this client
            downloads; ``None`` means all of them. Strategies whose clients keep the rest
            from earlier rounds (streaming DiLoCo's replica) name the part that changed, and
            the client's ``fit`` then receives only those tensors. Fleets honour it on an
            exact (lossless) downlink; on a lossy downlink every client holds the shared
            shadow and downloads what it would without it (see ``download_names``).
    """

    round: int
    config: Mapping[str, Scalar] = field(default_factory=dict)
    expected: "Mapping[str, TensorSpec] | None" = None
    download: "tuple[str, ...] | None" = None

    def download_names(self, *, lossless_downlink: bool, delta_uplink: bool) -> "frozenset[str] | None":
        """The tensors a fleet sends this client: ``download`` (``None``: all), on a lossless downlink.

        Args:
            lossless_downlink: the downlink codec is exact (``none``, ``zstd``); otherwise
                the client downloads everything, as without ``download``.
            delta_uplink: the client's uplink codec sends differences to the global model:
                the tensors it uploads (``expected``) are added, as the reference the
                difference is taken against on the client.
        """
        if self.download is None or not lossless_downlink:
            return None
        return frozenset(self.download) | (frozenset(self.expected or ()) if delta_uplink else frozenset())


@dataclass(frozen=True)
class EvaluateIns:
    """An evaluation task for one client: evaluate the global model on local data."""

    round: int
    config: Mapping[str, Scalar] = field(default_factory=dict)


@dataclass(frozen=True)
class FitRes:
    """A client's answer to a fit task.

    Attributes:
        client: who sent it.
        state: the tensors the client sends back (for FedAvg, its new weights).
        num_examples: examples trained on; the weight in averaging.
        metrics: scalar training metrics (``loss``, ...).
        delta: each floating tensor of ``state`` is a difference: the client's value minus
            the tensor of the same name in the state the fleet was given for the round
            (``Strategy.downlink_state``); other tensors are values. A fleet sets it for a
            lossy uplink over an exact downlink (see docs/updates.rst); ``False``: values.
        weight: its weight in a mean when that is not ``num_examples``: a late result of a
            semi-asynchronous round, discounted for its staleness
            (``fedgrid.aggregation.staleness``); ``None``: ``num_examples``.
        task_round: the round whose task it answers, when that is not the round it is
            aggregated in (a late result of a semi-asynchronous round: streaming DiLoCo merges
            it into its task's fragment); ``None``: the round it is aggregated in.
    """

    client: ClientInfo
    state: ModelState
    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    delta: bool = False
    weight: float | None = None
    task_round: int | None = None

    @property
    def mean_weight(self) -> float:
        """The weight of this result in a weighted mean: ``weight``, else ``num_examples``."""
        return float(self.num_examples) if self.weight is None else self.weight


@dataclass(frozen=True)
class EvaluateRes:
    """A client's evaluation of the global model on its own data."""

    client: ClientInfo
    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)


#: The two model phases of a round; every other phase name is a message phase.
FIT = "fit"
EVALUATE = "evaluate"
#: Recipients of a phase message besides a peer's client id: the coordinator (the strategy
#: reads it) and every other peer of the phase (one copy relayed to each).
TO_SERVER = ""
TO_ALL = "*"


class UpdateRole(enum.Enum):
    """What a strategy makes of the clients' updates: the capability it declares
    (``Strategy.update_role``) and that a codec states its preferences for
    (``Codec.form_under``, ``Codec.auto_strategy``), so that neither names the other.

    ``MODEL_AVERAGE``: the global model moves by the clients' mean update each round, and a
    client may sit rounds out between its uploads (FedAvg, and its server optimizers).
    ``OUTER_GRADIENT``: each worker's update is the pseudo-gradient of its many inner steps,
    and an outer optimizer steps on their mean at every synchronization (DiLoCo).
    """

    MODEL_AVERAGE = "model-average"
    OUTER_GRADIENT = "outer-gradient"


def check_phase_name(name: str) -> str:
    """Returns ``name`` if it is a valid phase name: ``fit``, ``evaluate``, or 1 to 32 of
    ``[a-z0-9_-]`` for a message phase (it becomes part of task ids).

    Raises:
        ValueError: any other name.
    """
    if name in (FIT, EVALUATE) or (
        0 < len(name) <= 32 and all(ch in "abcdefghijklmnopqrstuvwxyz0123456789_-" for ch in name)
    ):
        return name
    raise ValueError(f"phase name must be 'fit', 'evaluate' or 1 to 32 of [a-z0-9_-], got {name!r}")


@dataclass(frozen=True)
class MessageIns:
    """A message-phase task: the client sends small messages to its peers (or to the
    coordinator) and receives those addressed to it, relayed by the coordinator.

    Attributes:
        round: the server round.
        phase: the phase's name (``Strategy.phases``), e.g. ``advertise-keys``.
        client_id: the id of the client receiving this task (its own address).
        peers: the client ids taking part in the phase, the client itself included, in the
            strategy's order (e.g. the ring order); messages go to these ids only.
        config: scalars sent with the task.
    """

    round: int
    phase: str
    client_id: str = ""
    peers: tuple[str, ...] = ()
    config: Mapping[str, Scalar] = field(default_factory=dict)


@dataclass(frozen=True)
class MessageRes:
    """What a client sent in a message phase.

    Attributes:
        client: who sent it.
        messages: payload by recipient: a peer's client id, ``TO_ALL`` (every other peer),
            or ``TO_SERVER``.
    """

    client: ClientInfo
    messages: Mapping[str, bytes]


@dataclass(frozen=True)
class Failure:
    """A client that did not deliver: the reason is data, handed to the strategy."""

    client: ClientInfo
    reason: str


@dataclass(frozen=True)
class RoundMetrics:
    """One line of ``metrics.jsonl``."""

    round: int
    loss: float | None
    accuracy: float | None
    bytes_up: int
    bytes_down: int
    wall_s: float
    clients_ok: int
    clients_failed: int
    extra: Mapping[str, float] = field(default_factory=dict)

    @staticmethod
    def from_json(row: Mapping[str, object]) -> "RoundMetrics":
        """Inverse of ``to_json``: keys beyond the standard ones go to ``extra``."""
        standard = (
            "round",
            "loss",
            "accuracy",
            "bytes_up",
            "bytes_down",
            "wall_s",
            "clients_ok",
            "clients_failed",
        )
        r = dict(row)
        return RoundMetrics(
            round=int(r["round"]),  # type: ignore[call-overload]
            loss=r["loss"],  # type: ignore[arg-type]
            accuracy=r["accuracy"],  # type: ignore[arg-type]
            bytes_up=int(r["bytes_up"]),  # type: ignore[call-overload]
            bytes_down=int(r["bytes_down"]),  # type: ignore[call-overload]
            wall_s=float(r["wall_s"]),  # type: ignore[arg-type]
            clients_ok=int(r["clients_ok"]),  # type: ignore[call-overload]
            clients_failed=int(r["clients_failed"]),  # type: ignore[call-overload]
            extra={k: v for k, v in r.items() if k not in standard},  # type: ignore[misc]
        )

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "round": self.round,
            "loss": self.loss,
            "accuracy": self.accuracy,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "wall_s": round(self.wall_s, 6),
            "clients_ok": self.clients_ok,
            "clients_failed": self.clients_failed,
        }
        out.update(self.extra)
        return out
