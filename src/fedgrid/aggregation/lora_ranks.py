"""Clients of different LoRA ranks (``peft_rank``): each trains adapters of its own rank ``r_i``
no higher than the coordinator's ``r``, and ``lora_aggregation = "svd"`` merges them exactly.

Every side keeps the coordinator's scale ``s = alpha / r``: a client of rank ``r_i`` takes
``alpha_i = s * r_i`` (:func:`peft_at_rank`), so its update is ``s * B_i @ A_i`` and the scale
cancels from the arithmetic. A round then goes:

- download: a client of rank ``r_i`` receives every LoRA pair of the global model refactorized
  to its rank by truncated SVD of the product ``B @ A`` (:func:`state_at_rank`; the global
  pair is already in SVD form after an ``svd`` round, so this is its leading ``r_i``
  components). The seeded first adapter has ``B = 0``: its rank-``r_i`` start is the first
  ``r_i`` rows of ``A`` and columns of ``B`` (a zero A would never train).
- upload: factors of the client's own shapes (:func:`specs_at_rank`; anything else is refused),
  differences taken against its own download.
- aggregate: ``M = sum_i w_i B_i @ A_i / sum_i w_i`` over the clients' own ranks, then the
  truncated SVD to ``r`` (``fedgrid.aggregation.lora.svd_average``).

``factors`` and ``ffa`` average the factors element by element, which needs one shape:
:func:`check_client_rank` refuses mixed ranks with them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping

import torch

from fedgrid.aggregation.lora import LORA_A, LORA_B, lora_pairs, svd_merge
from fedgrid.errors import AdapterRankError
from fedgrid.types import ModelState, TensorSpec

__all__ = ["adapter_rank", "state_at_rank", "specs_at_rank", "check_client_rank", "RankPolicy", "RankViews"]


def adapter_rank(state: Mapping[str, object]) -> int:
    """The rank of the LoRA pairs of ``state`` (a model's tensors or specs), 0 when it has none."""
    for name, value in state.items():
        if LORA_A in name:
            shape = value.shape if isinstance(value, (torch.Tensor, TensorSpec)) else ()
            return int(shape[0]) if shape else 0
    return 0


def _pair_at_rank(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not bool(b.any()):  # the seeded start: no product to refactorize, keep A's leading rows
        return a[:rank].clone(), b[:, :rank].clone()
    return svd_merge([(a, b)], [1.0], rank=rank, scale=1.0, dtype=a.dtype)


def state_at_rank(state: Mapping[str, torch.Tensor], rank: int) -> ModelState:
    """``state`` with every LoRA pair refactorized to ``rank`` (the module's docstring); the
    other tensors are the same objects. ``rank`` equal to the state's own returns a plain copy
    of the mapping."""
    out: ModelState = OrderedDict(state.items())
    if rank == adapter_rank(state):
        return out
    for a_name, b_name in lora_pairs(list(state)).items():
        out[a_name], out[b_name] = _pair_at_rank(state[a_name], state[b_name], rank)
    return out


def specs_at_rank(specs: Mapping[str, TensorSpec], rank: int) -> "OrderedDict[str, TensorSpec]":
    """The specs of ``specs``'s model at LoRA rank ``rank``: A ``[rank, in]``, B ``[out, rank]``."""
    out: OrderedDict[str, TensorSpec] = OrderedDict()
    for name, spec in specs.items():
        if LORA_A in name:
            spec = TensorSpec(spec.dtype, (rank, *spec.shape[1:]))
        elif LORA_B in name:
            spec = TensorSpec(spec.dtype, (spec.shape[0], rank, *spec.shape[2:]))
        out[name] = spec
    return out


def check_client_rank(rank: int, *, bound: int, aggregation: str | None, lossless_downlink: bool) -> None:
    """A client announcing LoRA rank ``rank`` (0: none announced, it takes the coordinator's)
    to a coordinator whose adapters have rank ``bound`` (0: it fine-tunes none).

    Raises:
        AdapterRankError: a rank on a run without adapters, below 1 or above ``bound``, or one
            other than ``bound`` unless ``aggregation`` is ``svd`` over a lossless downlink
            (names the key at fault).
    """
    if rank == 0 or rank == bound:
        return
    if bound == 0:
        raise AdapterRankError(
            "peft_rank", f"the client trains LoRA rank {rank}: this run fine-tunes no adapters"
        )
    if not 1 <= rank <= bound:
        raise AdapterRankError("peft_rank", f"{rank} is outside [1, {bound}] (the coordinator's peft rank r)")
    if aggregation != "svd":
        raise AdapterRankError(
            "lora_aggregation",
            f"{aggregation or 'factors'} averages factors of one shape: a client of rank {rank} beside the "
            f"coordinator's {bound} needs lora_aggregation = svd",
        )
    if not lossless_downlink:
        raise AdapterRankError(
            "downlink_codec",
            f"a client of LoRA rank {rank} (the coordinator's is {bound}) downloads its own refactorized "
            "adapters whole: use downlink_codec = none",
        )


@dataclass(frozen=True)
class RankPolicy:
    """The LoRA ranks a coordinator takes at Join: ``bound``, its adapters' rank (0: none), and
    what :func:`check_client_rank` needs besides."""

    bound: int = 0
    aggregation: str | None = None
    lossless_downlink: bool = True

    def check(self, rank: int) -> None:
        """:func:`check_client_rank` of ``rank`` under this policy."""
        check_client_rank(
            rank, bound=self.bound, aggregation=self.aggregation, lossless_downlink=self.lossless_downlink
        )


class RankViews:
    """One round's global model at each client rank asked for, refactorized once per rank."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = state
        self.rank = adapter_rank(state)
        self._views: dict[int, ModelState] = {}

    def differs(self, rank: int) -> bool:
        """Whether a client of ``rank`` (0: the coordinator's) holds other shapes than the round's
        (never when the round's model has no A factors: no adapters, or FFA-LoRA's B alone)."""
        return self.rank > 0 and rank not in (0, self.rank)

    def at(self, rank: int) -> ModelState:
        """The round's model at ``rank`` (the model itself for 0 or the round's rank)."""
        if not self.differs(rank):
            return OrderedDict(self.state.items())
        if rank not in self._views:
            self._views[rank] = state_at_rank(self.state, rank)
        return self._views[rank]
