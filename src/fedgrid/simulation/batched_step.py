"""The batched engine's step: every client's forward and backward in one call.

``step_function`` builds ``torch.func.vmap`` over ``grad_and_value`` of ``functional_call``
for one model and loss: the objective is a client's mean per-example loss over its own
(masked) rows of a padded batch, plus a proximal term (FedProx) when ``mu`` is set. The
trial step (``batched_trial``) and training (``batched``) run it. Part of the batched
engine (``fedgrid.simulation.batched``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.func import functional_call, grad_and_value, vmap

from fedgrid.simulation.batched_models import ModelLayout, per_example_loss

__all__ = ["step_function"]


def step_function(m: ModelLayout, loss_fn: Callable[..., Any], mu: float) -> Callable[..., Any]:
    """``(trained, frozen, anchor, x, y, mask, count) -> (grads, (objective, loss))``, batched
    over the leading dimension of each argument (``anchor``: only with ``mu``, else ``None``)."""
    template, per_example = m.template, per_example_loss(loss_fn)

    def objective(
        trained: dict[str, torch.Tensor],
        frozen: dict[str, torch.Tensor],
        anchor: dict[str, torch.Tensor] | None,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor,
        count: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        per = per_example(functional_call(template, (trained, frozen), (x,)), y)
        loss = torch.where(mask, per, 0.0).sum() / count
        if anchor is None:
            return loss, loss
        total = sum(((trained[n] - anchor[n]) ** 2).sum() for n in trained)
        return loss + 0.5 * mu * torch.as_tensor(total), loss

    return vmap(grad_and_value(objective, has_aux=True), in_dims=(0, 0, 0 if mu else None, 0, 0, 0, 0))
