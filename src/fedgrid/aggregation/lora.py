"""LoRA-aware aggregation: averaging the factors A and B of an adapter is not averaging its update.

A LoRA adapter on a linear layer adds ``s * B @ A`` to its weight (``A``: ``[r, in]``, ``B``:
``[out, r]``, ``s = alpha / r``). The rules of ``lora_aggregation``:

- ``factors``: FedAvg on the factors, ``A = sum_i w_i A_i``, ``B = sum_i w_i B_i`` (weights
  normalized), so the merged update is ``s * B @ A``, which is *not* ``sum_i w_i s B_i @ A_i``:
  the cross terms ``B_i @ A_j`` enter it. The plain mean of the state (``FedAvg`` itself).
- ``svd``: the weighted mean of the products, ``M = sum_i w_i s_i B_i @ A_i`` (clients may hold
  different ranks ``r_i`` and so scales ``s_i``), refactorized by its truncated SVD to the
  global rank ``r``: ``M ~ U_r S_r V_r^T``, ``B = U_r sqrt(S_r / s)``, ``A = sqrt(S_r / s) V_r^T``
  (FlexLoRA, Bai et al. 2024). Exact (``s * B @ A == M``) when ``rank(M) <= r``, e.g. when every
  client trained only B from one shared A, or when ``sum_i r_i <= r``; otherwise the best rank-r
  approximation in Frobenius norm (Eckart-Young).
- ``ffa``: A frozen at its seeded initialization on every side and never sent (FFA-LoRA, Sun et
  al. 2024); B is averaged, and ``s * mean(B_i) @ A == mean(s * B_i @ A)`` exactly.

The pairs are found by name: PEFT names a layer's factors ``...lora_A.<adapter>.weight`` and
``...lora_B.<adapter>.weight``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Mapping, Sequence

import torch

from fedgrid.types import FitRes

__all__ = ["LORA_AGGREGATIONS", "lora_pairs", "svd_merge", "svd_average", "product_mean", "LORA_A", "LORA_B"]

#: Values of ``lora_aggregation`` (the rules above).
LORA_AGGREGATIONS = ("factors", "svd", "ffa")
LORA_A, LORA_B = ".lora_A.", ".lora_B."


def lora_pairs(names: Sequence[str]) -> OrderedDict[str, str]:
    """The ``lora_A`` name of each adapter in ``names`` mapped to its ``lora_B`` name.

    Raises:
        ValueError: a factor without its partner among ``names``.
    """
    present = set(names)
    pairs: OrderedDict[str, str] = OrderedDict()
    for name in names:
        if LORA_A in name:
            partner = name.replace(LORA_A, LORA_B)
            if partner not in present:
                raise ValueError(f"LoRA factor {name!r} has no {partner!r} beside it")
            pairs[name] = partner
        elif LORA_B in name and name.replace(LORA_B, LORA_A) not in present:
            raise ValueError(f"LoRA factor {name!r} has no {name.replace(LORA_B, LORA_A)!r} beside it")
    return pairs


def product_mean(
    factors: Sequence[tuple[torch.Tensor, torch.Tensor]], weights: Sequence[float], scales: Sequence[float]
) -> torch.Tensor:
    """``sum_i w_i s_i B_i @ A_i / sum_i w_i`` in float64, for ``(A_i, B_i)`` of any ranks.

    Raises:
        ValueError: no factors, a non-positive weight, or shapes that do not multiply to one shape.
    """
    if not factors:
        raise ValueError("no LoRA factors to average")
    total = float(sum(weights))
    out: torch.Tensor | None = None
    for (a, b), w, s in zip(factors, weights, scales, strict=True):
        if not w > 0:
            raise ValueError(f"weights must be positive, got {w}")
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise ValueError(f"LoRA factors of shapes A {list(a.shape)}, B {list(b.shape)} do not multiply")
        term = (b.double() @ a.double()).mul_(w * s / total)
        if out is not None and term.shape != out.shape:
            raise ValueError(f"LoRA products of shapes {list(out.shape)} and {list(term.shape)} differ")
        out = term if out is None else out.add_(term)
    assert out is not None
    return out


def svd_merge(
    factors: Sequence[tuple[torch.Tensor, torch.Tensor]],
    weights: Sequence[float],
    *,
    rank: int,
    scale: float,
    scales: Sequence[float] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global ``(A, B)`` of rank ``rank`` and scale ``scale`` whose ``scale * B @ A`` is the
    truncated SVD of :func:`product_mean` (``scales``: each client's ``s_i``, default ``scale``).
    Ranks above the product's own give zero rows of A and columns of B."""
    mean = product_mean(factors, weights, scales if scales is not None else [scale] * len(factors))
    u, sv, vh = torch.linalg.svd(mean, full_matrices=False)
    k = min(rank, sv.numel())
    root = (sv[:k] / scale).sqrt()
    b = torch.zeros(mean.shape[0], rank, dtype=torch.float64)
    a = torch.zeros(rank, mean.shape[1], dtype=torch.float64)
    b[:, :k] = u[:, :k] * root
    a[:k] = root[:, None] * vh[:k]
    return a.to(dtype), b.to(dtype)


def svd_average(
    global_state: Mapping[str, torch.Tensor],
    results: Sequence[FitRes],
    names: Sequence[str],
    at_rank: Callable[[int], Mapping[str, torch.Tensor]] | None = None,
) -> OrderedDict[str, torch.Tensor]:
    """The ``svd`` rule's new values of the LoRA pairs among ``names``, from ``results`` (values or
    deltas; weights ``mean_weight``); every client and the global model share one scale, which
    cancels, and the rank is the global A's.

    A delta result's factors are differences from the pair its client downloaded: the global
    one, or for a client of its own LoRA rank ``at_rank(rank)``'s (``lora_ranks.RankViews``).
    Its product is taken from that pair and the differences in float64: the update is not
    made a value of the model's dtype on its way (``tests/integration/test_update_form.py``).

    Raises:
        ValueError: a result without one of the factors (naming the client and the tensor), or
            of another rank than the global pair's without ``at_rank``.
    """
    weights = [res.mean_weight for res in results]
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for a_name, b_name in lora_pairs(names).items():
        factors = [_client_factors(global_state, res, a_name, b_name, at_rank) for res in results]
        target = global_state[a_name]
        out[a_name], out[b_name] = svd_merge(
            factors, weights, rank=target.shape[0], scale=1.0, dtype=target.dtype
        )
    return out


def _client_factors(
    global_state: Mapping[str, torch.Tensor],
    res: FitRes,
    a_name: str,
    b_name: str,
    at_rank: Callable[[int], Mapping[str, torch.Tensor]] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``res``'s factors ``(A_i, B_i)`` of the pair ``a_name``: as sent for a value result; for a
    delta result, its differences added to the pair it downloaded, in float64."""
    a, b = res.state.get(a_name), res.state.get(b_name)
    if a is None or b is None:
        who = res.client.name or res.client.client_id
        raise ValueError(f"result from client {who!r} lacks LoRA factor {a_name if a is None else b_name!r}")
    if not res.delta:
        return a, b
    rank = a.shape[0]
    base = global_state
    if rank != global_state[a_name].shape[0]:
        if at_rank is None:
            raise ValueError(f"LoRA factor {a_name!r} of rank {rank}: no model at that rank to add it to")
        base = at_rank(rank)
    return base[a_name].double() + a.double(), base[b_name].double() + b.double()
