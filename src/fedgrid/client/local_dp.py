"""Local differential privacy for ``TorchClient``: DP-SGD on the client through Opacus (the
``privacy`` extra), an option of the SDK (``TorchClient(..., local_dp=LocalDP(...))``).

Every local step clips each example's gradient to ``max_grad_norm`` and adds Gaussian noise of
std ``noise_multiplier * max_grad_norm`` to their sum (Opacus' ``GradSampleModule`` and
``DPOptimizer`` around the optimizer the task's algorithm builds), so what the client uploads
is example-level private whatever the server does. Opacus' RDP accountant counts every step at
the sampling rate ``batch size / examples held``; a fit's metrics carry ``local_epsilon``, the
epsilon spent so far at ``delta``, and ``TorchClient.state_dict`` keeps the accountant's history,
so a client restored from its state keeps its budget.

The noise of a task is drawn from a generator seeded with the task's round seed (the one that
shuffles its batches), so a simulation and a deployment draw the same bits; it is not a
cryptographic generator (Opacus' ``secure_mode`` needs ``torchcsprng``). Batches are the
loader's, not Poisson-sampled: the accountant's rate is the standard approximation.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

__all__ = ["LocalDP", "LOCAL_EPSILON"]

#: The fit metric of the epsilon a client's local DP has spent so far.
LOCAL_EPSILON = "local_epsilon"


class LocalDP:
    """DP-SGD settings of a ``TorchClient`` and its accountant (module docstring).

    Args:
        noise_multiplier: sigma; the noise on a batch's summed clipped gradients has std
            ``sigma * max_grad_norm``.
        max_grad_norm: the L2 norm each example's gradient is clipped to.
        delta: the delta of the ``local_epsilon`` reported.

    Raises:
        ValueError: a value out of range.
        ImportError: Opacus is not installed (``pip install 'fedgrid[privacy]'``).
    """

    def __init__(self, *, noise_multiplier: float, max_grad_norm: float, delta: float = 1e-5) -> None:
        if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
            raise ValueError(f"noise_multiplier must be a finite number above 0, got {noise_multiplier}")
        if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a finite number above 0, got {max_grad_norm}")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        try:
            from opacus.accountants import RDPAccountant
        except ImportError:
            raise ImportError("local DP needs Opacus: pip install 'fedgrid[privacy]'") from None
        self.noise_multiplier = noise_multiplier
        self.max_grad_norm = max_grad_norm
        self.delta = delta
        self.accountant = RDPAccountant()
        self._wrapped: tuple[nn.Module, nn.Module] | None = None

    def module(self, model: nn.Module) -> nn.Module:
        """``model`` wrapped to compute per-example gradients (once; the wrapper shares its parameters)."""
        if self._wrapped is None or self._wrapped[0] is not model:
            from opacus import GradSampleModule

            self._wrapped = (model, GradSampleModule(model))
        return self._wrapped[1]

    def optimizer(
        self, optimizer: torch.optim.Optimizer, *, batch_size: int, examples: int, seed: int
    ) -> torch.optim.Optimizer:
        """``optimizer`` as a DP-SGD step: per-example clipping, then noise from a generator seeded
        with ``seed``; each step is accounted at rate ``batch_size / examples``.

        Raises:
            ValueError: ``batch_size`` or ``examples`` below 1.
        """
        if batch_size < 1 or examples < 1:
            raise ValueError(
                f"local DP needs the loader's batch size and the examples held, got {batch_size}, {examples}"
            )
        from opacus.optimizers import DPOptimizer

        generator = torch.Generator().manual_seed(seed)
        private = DPOptimizer(
            optimizer,
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=self.max_grad_norm,
            expected_batch_size=batch_size,
            generator=generator,
        )
        rate = min(1.0, batch_size / examples)
        private.attach_step_hook(
            lambda _: self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=rate)
        )
        return private

    def metrics(self) -> dict[str, float]:
        """``local_epsilon``: spent so far at ``delta`` (0 before any step)."""
        if not self.accountant.history:
            return {LOCAL_EPSILON: 0.0}
        return {LOCAL_EPSILON: float(self.accountant.get_epsilon(self.delta))}

    def state_dict(self) -> dict[str, Any]:
        return {"history": [list(h) for h in self.accountant.history]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.accountant.history = [(float(s), float(q), int(n)) for s, q, n in state.get("history", [])]
