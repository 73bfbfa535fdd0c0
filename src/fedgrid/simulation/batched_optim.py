"""Batched optimizers: one ``torch.optim`` update applied to K clients' stacked parameters.

``optimizer_spec`` reads what a client's optimizer factory builds (SGD, Adam or AdamW and
their hyperparameters); ``BatchedOptimizer`` then steps stacked tensors (leading dimension
K, one slice per client) with the same formulas as ``torch.optim``'s single-tensor
implementations (``torch/optim/sgd.py`` and ``adam.py``, ``_single_tensor_*``), so each
client's slice moves exactly as its own optimizer would move it.

Clients of one chunk start the round together and the engine sorts them by their number
of steps, so at step ``s`` every active client has taken ``s`` steps before: Adam's bias
corrections are the same scalar for all of them, and the active clients are a prefix
``[:k]`` of the stacks (the optimizer state is sliced, never gathered).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["OptimizerSpec", "NotBatchable", "optimizer_spec", "BatchedOptimizer"]


class NotBatchable(Exception):
    """Why a client, model or optimizer cannot train in the batched engine (the message says)."""


@dataclass(frozen=True)
class OptimizerSpec:
    """A client's optimizer: ``kind`` is ``sgd`` or ``adam`` (AdamW: ``decoupled``)."""

    kind: str
    lr: float
    weight_decay: float = 0.0
    maximize: bool = False
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    decoupled: bool = False

    def with_lr(self, lr: float) -> "OptimizerSpec":
        return OptimizerSpec(**{**self.__dict__, "lr": float(lr)})

    @property
    def states(self) -> int:
        """Tensors of optimizer state per parameter (for memory estimates)."""
        if self.kind == "adam":
            return 2
        return 1 if self.momentum else 0


def _scalar(value: object) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)  # type: ignore[arg-type]


def optimizer_spec(optimizer: torch.optim.Optimizer) -> OptimizerSpec:
    """The spec of ``optimizer``, built over all of a model's parameters.

    Raises:
        NotBatchable: not exactly ``torch.optim.SGD``, ``Adam`` or ``AdamW`` with one
            parameter group, or an option the batched step does not implement (AMSGrad,
            differentiable, a tensor learning rate that requires grad).
    """
    kind = type(optimizer)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if kind not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        raise NotBatchable(f"optimizer {name} is not one the batched engine implements (SGD, Adam, AdamW)")
    if len(optimizer.param_groups) != 1:
        raise NotBatchable(
            f"optimizer {name} has {len(optimizer.param_groups)} parameter groups; the batched engine needs one"
        )
    g = optimizer.param_groups[0]
    if g.get("differentiable"):
        raise NotBatchable(f"optimizer {name} is differentiable=True")
    common: dict[str, Any] = dict(
        lr=_scalar(g["lr"]), weight_decay=_scalar(g["weight_decay"]), maximize=bool(g.get("maximize", False))
    )
    if kind is torch.optim.SGD:
        return OptimizerSpec(
            "sgd",
            momentum=_scalar(g["momentum"]),
            dampening=_scalar(g["dampening"]),
            nesterov=bool(g["nesterov"]),
            **common,
        )
    if g.get("amsgrad"):
        raise NotBatchable(f"optimizer {name} uses amsgrad, which the batched engine does not implement")
    beta1, beta2 = g["betas"]
    decoupled = kind is torch.optim.AdamW or bool(g.get("decoupled_weight_decay", False))
    return OptimizerSpec(
        "adam",
        beta1=_scalar(beta1),
        beta2=_scalar(beta2),
        eps=_scalar(g["eps"]),
        decoupled=decoupled,
        **common,
    )


class BatchedOptimizer:
    """Steps stacked parameters (leading dimension K) as ``spec``'s ``torch.optim`` would.

    Args:
        spec: the optimizer's kind and hyperparameters.
        params: the stacked parameters, each ``[K, ...]``; ``step`` updates prefixes of them.
    """

    def __init__(self, spec: OptimizerSpec, params: Sequence[torch.Tensor]) -> None:
        self.spec = spec
        self._buf: list[torch.Tensor] | None = None  # SGD momentum, created from the first gradient
        self._exp_avg = [torch.zeros_like(p) for p in params] if spec.kind == "adam" else []
        self._exp_avg_sq = [torch.zeros_like(p) for p in params] if spec.kind == "adam" else []

    @torch.no_grad()
    def step(self, step: int, k: int, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Applies step number ``step`` (0-based) to ``params``: the ``[:k]`` views of the stacks.

        ``grads`` (fresh tensors, same shapes as ``params``) may be overwritten.
        """
        s = self.spec
        if s.maximize:
            grads = list(torch._foreach_neg(grads))
        if s.kind == "sgd":
            self._sgd(step, k, params, grads)
        else:
            self._adam(step, k, params, grads)

    def _sgd(self, step: int, k: int, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        s = self.spec
        if s.weight_decay != 0:
            grads = list(torch._foreach_add(grads, params, alpha=s.weight_decay))
        if s.momentum != 0:
            if self._buf is None:
                # torch initialises the buffer to the first gradient (all clients are at step 0 together).
                self._buf = [g.detach().clone() for g in grads]
                bufs = self._buf
            else:
                bufs = [b[:k] for b in self._buf]
                torch._foreach_mul_(bufs, s.momentum)
                torch._foreach_add_(bufs, grads, alpha=1 - s.dampening)
            if s.nesterov:
                grads = list(torch._foreach_add(grads, bufs, alpha=s.momentum))
            else:
                grads = bufs
        torch._foreach_add_(params, grads, alpha=-s.lr)

    def _adam(self, step: int, k: int, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        s = self.spec
        if s.weight_decay != 0:
            if s.decoupled:
                torch._foreach_mul_(params, 1 - s.lr * s.weight_decay)
            else:
                grads = list(torch._foreach_add(grads, params, alpha=s.weight_decay))
        exp_avg = [m[:k] for m in self._exp_avg]
        exp_avg_sq = [v[:k] for v in self._exp_avg_sq]
        torch._foreach_lerp_(exp_avg, grads, 1 - s.beta1)
        torch._foreach_mul_(exp_avg_sq, s.beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - s.beta2)
        # torch keeps the step count as a float32 tensor and reads it back as a Python float:
        # the same rounding, on the host (no tensor read back, so no device sync on CUDA).
        t = array("f", [step + 1])[0]
        bias_correction1 = 1 - s.beta1**t
        bias_correction2 = 1 - s.beta2**t
        step_size = s.lr / bias_correction1
        denom = list(torch._foreach_sqrt(exp_avg_sq))
        torch._foreach_div_(denom, bias_correction2**0.5)
        torch._foreach_add_(denom, s.eps)
        torch._foreach_addcdiv_(params, exp_avg, denom, value=-step_size)
