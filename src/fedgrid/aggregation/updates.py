"""Client updates as deltas from the global model: the common input of every aggregator.

Strategies other than plain FedAvg aggregate *updates*, ``delta_i = client_i - global``,
over the real floating tensors of the model, and apply the aggregate (directly, or as the
pseudo-gradient ``-delta`` of a server optimizer). Every other tensor (integer or bool
buffers such as BatchNorm's ``num_batches_tracked``, complex tensors) takes the
example-weighted mean of the clients' values, as in FedAvg.

Deltas are computed in float32 (float64 for float64 tensors), so a bfloat16 model's
updates are not rounded to bfloat16 before they are averaged.

A result may already hold deltas (``FitRes.delta``: a lossy uplink sends differences, see
docs/updates.rst): ``client_delta`` and ``client_difference`` then take them as they are,
with no pass over the model and no rounding; ``client_value`` and ``as_model`` add the global
model back for whoever needs values (a strategy that declares it: ``accepts_deltas = False``;
LoRA's ``svd`` takes its products from the differences, ``aggregation.lora``). On the way
from a client's fit to its strategy, an update changes form at most once
(tests/integration/test_update_form.py).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Mapping, Sequence, cast

import torch

from fedgrid.aggregation.base import Aggregator
from fedgrid.aggregation.mean import WeightedMean
from fedgrid.types import FitRes, ModelState

__all__ = [
    "is_optimizable",
    "compute_dtype",
    "split_names",
    "client_delta",
    "check_result",
    "client_value",
    "client_difference",
    "as_model",
    "aggregate_deltas",
    "average_values",
    "add_update",
]


def is_optimizable(dtype: torch.dtype) -> bool:
    """True for real floating dtypes: the tensors that deltas, clipping and server optimizers touch."""
    return dtype.is_floating_point


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype deltas and optimizer state of a ``dtype`` tensor are held in (at least float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def split_names(
    state: Mapping[str, torch.Tensor], names: Sequence[str] | None = None
) -> tuple[list[str], list[str]]:
    """Splits ``names`` (default: all of ``state``) into (real floating, everything else), in order."""
    chosen = list(state) if names is None else list(names)
    floating = [n for n in chosen if is_optimizable(state[n].dtype)]
    others = [n for n in chosen if not is_optimizable(state[n].dtype)]
    return floating, others


def client_delta(global_state: Mapping[str, torch.Tensor], res: FitRes, names: Sequence[str]) -> ModelState:
    """``res.state[n] - global_state[n]`` for each of ``names``, in the compute dtype; for a
    result holding deltas (``res.delta``), ``res.state[n]`` itself.

    Raises:
        ValueError: the result lacks one of ``names`` or holds it with another shape.
    """
    out: ModelState = OrderedDict()
    for name in names:
        ref = global_state[name]
        got = _checked(global_state, res, name)
        dtype = compute_dtype(ref.dtype)
        if res.delta and is_optimizable(got.dtype):  # already a difference: as sent
            out[name] = got.detach().to("cpu", dtype)
        else:
            out[name] = got.detach().to("cpu", dtype) - ref.detach().to("cpu", dtype)
    return out


def check_result(global_state: Mapping[str, torch.Tensor], res: FitRes, names: Sequence[str]) -> None:
    """The checks ``client_delta`` makes, without its arithmetic.

    Raises:
        ValueError: the result lacks one of ``names`` or holds it with another shape.
    """
    for name in names:
        _checked(global_state, res, name)


def _checked(global_state: Mapping[str, torch.Tensor], res: FitRes, name: str) -> torch.Tensor:
    got = res.state.get(name)
    who = res.client.name or res.client.client_id
    if got is None:
        raise ValueError(f"result from client {who!r} lacks tensor '{name}'")
    ref = global_state[name]
    if got.shape != ref.shape:
        raise ValueError(
            f"result from client {who!r}: tensor '{name}' has shape {list(got.shape)}, expected {list(ref.shape)}"
        )
    return got


def client_value(
    global_state: Mapping[str, torch.Tensor], res: FitRes, name: str, part: slice | None = None
) -> torch.Tensor | None:
    """The client's value of tensor ``name`` (``None`` if the result lacks it): ``res.state[name]``,
    or for a delta result's floating tensor ``global_state[name] + res.state[name]`` in the
    model's dtype, the same bits the fleet's add-back gave. ``part``: only that slice of the
    flattened tensor (the sum is then computed for the slice alone).
    """
    got = res.state.get(name)
    if got is None:
        return None
    if part is not None:
        got = got.reshape(-1)[part]
    if not (res.delta and is_optimizable(got.dtype)):
        return got
    ref = global_state[name]
    return (ref if part is None else ref.reshape(-1)[part]).to(got.device) + got


def client_difference(
    global_state: Mapping[str, torch.Tensor], res: FitRes, name: str, part: slice | None = None
) -> torch.Tensor | None:
    """The client's difference from the global model of the floating tensor ``name``, in the
    compute dtype (``None`` if the result lacks it): a delta result's ``res.state[name]`` as
    sent; a value result's ``res.state[name] - global_state[name]``. ``part``: only that slice of
    the flattened tensor. (``client_delta`` is the same over whole tensors, shapes checked.)
    """
    got = res.state.get(name)
    if got is None:
        return None
    ref = global_state[name]
    if part is not None:
        got, ref = got.reshape(-1)[part], ref.reshape(-1)[part]
    dtype = compute_dtype(ref.dtype)
    if res.delta and is_optimizable(got.dtype):  # already a difference: as sent
        return got.detach().to("cpu", dtype)
    return got.detach().to("cpu", dtype) - ref.detach().to("cpu", dtype)


def as_model(global_state: Mapping[str, torch.Tensor], res: FitRes) -> FitRes:
    """``res`` holding values: a delta result with the global model added back (``client_value``);
    any other result as it is."""
    if not res.delta:
        return res
    # Every name of res.state has a value: client_value's None (a missing tensor) cannot occur here.
    state: ModelState = OrderedDict(
        (name, cast(torch.Tensor, client_value(global_state, res, name))) for name in res.state
    )
    return dataclasses.replace(res, state=state, delta=False)


def aggregate_deltas(
    *,
    global_state: Mapping[str, torch.Tensor],
    results: Sequence[FitRes],
    names: Sequence[str],
    aggregator: Aggregator | None = None,
) -> ModelState:
    """The aggregate of the clients' deltas over the floating ``names``.

    Args:
        global_state: the model the clients started from.
        results: the round's results, in canonical order (the order ties are broken in).
        names: real floating tensor names, all present in every result.
        aggregator: the rule; ``None`` is the example-weighted mean. It is ``reset`` first.

    Returns:
        One delta per name, in the compute dtype.

    Raises:
        AggregationPreconditionError: the aggregator cannot run on ``len(results)`` updates.
        ValueError: a result is malformed (missing tensor, wrong shape, weight not positive).
    """
    agg = aggregator if aggregator is not None else WeightedMean()
    agg.reset()
    for res in results:
        agg.add(client_delta(global_state, res, names), res.mean_weight)
    out = agg.result()
    agg.reset()  # drop the buffered updates now rather than at the next round
    return out


def average_values(
    results: Sequence[FitRes], names: Sequence[str], *, aggregator: Aggregator | None = None
) -> ModelState:
    """The example-weighted mean of the clients' own values of ``names`` (FedAvg's rule); with an
    ``aggregator`` that ignores weights (a robust rule, ``weighted=False``), the plain mean: the
    tensors the rule does not see (integer buffers) must not hand a client's claim the weight
    the rule denies it."""
    if not names:
        return OrderedDict()
    weighted = aggregator is None or getattr(aggregator, "weighted", True)
    agg = WeightedMean()
    for res in results:
        agg.add(OrderedDict((n, res.state[n]) for n in names), res.mean_weight if weighted else 1.0)
    return agg.result()


def add_update(global_state: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor]) -> ModelState:
    """``global + update`` for each name of ``update`` (an aggregated difference), cast back to the global
    tensor's dtype. (``fedgrid.compression.feedback.apply_delta`` is what a receiver of one delta runs.)"""
    out: ModelState = OrderedDict()
    for name, d in update.items():
        ref = global_state[name]
        out[name] = (ref.to(d.dtype) + d).to(ref.dtype)
    return out
