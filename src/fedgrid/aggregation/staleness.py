"""Late results of semi-asynchronous rounds (FedBuff): the staleness discount and the rebase.

A result that lands after its round closed at its quorum is merged into a later round, the
one open when it lands (or the next to open). Its *staleness* is ``s = merging round - task
round``; its weight in the merge is ``num_examples * (1 + s) ** -a`` (FedBuff's polynomial
discount, ``a``: ``staleness_exponent``). It trained from its task's global model, not the
current one, so it enters the merge as its *difference* from that model (``rebase``): a
strategy that takes differences (``Strategy.accepts_deltas``) adds the weighted mean of them
to the current model through its own rule; model averaging (FedAvg) sees ``current + delta``,
so that its mean is ``current + weighted mean of the deltas``, which is today's FedAvg when
every result is fresh. Pure: tensors in, tensors out.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Mapping

import torch

from fedgrid.aggregation.updates import compute_dtype, is_optimizable
from fedgrid.types import FitRes, ModelState

__all__ = ["staleness_weight", "rebase"]


def staleness_weight(num_examples: int, staleness: int, exponent: float) -> float:
    """``num_examples * (1 + staleness) ** -exponent``: a late result's weight in its merge.

    Raises:
        ValueError: a negative ``staleness`` or ``exponent``.
    """
    if staleness < 0:
        raise ValueError(f"staleness must be at least 0, got {staleness}")
    if exponent < 0:
        raise ValueError(f"the staleness exponent must be at least 0, got {exponent}")
    return float(num_examples) * float(1 + staleness) ** -exponent


def rebase(res: FitRes, base: Mapping[str, torch.Tensor], *, weight: float) -> FitRes:
    """``res`` as differences from ``base`` (the model its task sent), weighted ``weight``.

    A result that already holds differences from ``base`` (``res.delta``) keeps its tensors
    as they are; one holding values has ``base`` subtracted from each real floating tensor,
    in the compute dtype (``updates.compute_dtype``). Other tensors (integer buffers) stay
    values, as in every delta result.

    Raises:
        ValueError: a tensor of ``res`` that ``base`` lacks, or of another shape.
    """
    if res.delta:
        return dataclasses.replace(res, weight=weight)
    state: ModelState = OrderedDict()
    for name, value in res.state.items():
        ref = base.get(name)
        if ref is None or ref.shape != value.shape:
            raise ValueError(
                f"late result from client {res.client.name or res.client.client_id!r}: tensor "
                f"'{name}' does not match its task's model"
            )
        if is_optimizable(value.dtype):
            dtype = compute_dtype(ref.dtype)
            state[name] = value.detach().to("cpu", dtype) - ref.detach().to("cpu", dtype)
        else:
            state[name] = value
    return dataclasses.replace(res, state=state, delta=True, weight=weight)
