"""Server optimizers: how a round's aggregated update moves the global model.

Following Reddi et al. 2021 ("Adaptive Federated Optimization", Algorithm 2), the server
treats the round's aggregated client change as a gradient. Here the *pseudo-gradient* is

    g = global - aggregate(client models)  =  -aggregate(client - global)

so every optimizer descends along ``-g`` like a ``torch.optim`` optimizer would; Reddi et
al.'s ``Delta_t`` is ``-g``. Per tensor, with ``lr`` the server learning rate:

- ``ServerSGD``: ``x -= lr * g``; with ``momentum`` ``b = mu * b + g`` (the first ``b = g``)
  and ``x -= lr * b``, or with ``nesterov`` ``x -= lr * (g + mu * b)``, exactly
  ``torch.optim.SGD`` with ``dampening=0``. ``lr=1`` without momentum is FedAvg; momentum is
  FedAvgM (Hsu et al. 2019); Nesterov with ``lr=0.7, momentum=0.9`` is DiLoCo's outer
  optimizer (Douillard et al. 2023).
- ``ServerAdam`` / ``ServerYogi`` / ``ServerAdagrad``: ``m = b1 * m + (1 - b1) * g`` (``m``
  starts at 0), ``v`` per the rule below (``v`` starts at ``tau**2``, the paper's
  ``v_{-1} >= tau^2``), ``x -= lr * m / (sqrt(v) + tau)``:

  - Adam:    ``v = b2 * v + (1 - b2) * g**2``
  - Yogi:    ``v = v - (1 - b2) * g**2 * sign(v - g**2)``
  - Adagrad: ``v = v + g**2``

  As in the paper, there is NO bias correction (unlike ``torch.optim.Adam``); ``tau``
  (the paper's adaptivity degree) plays the role of Adam's epsilon.

Only real floating tensors are optimized (``step`` refuses others); state is kept per
tensor name, in float32 (float64 for float64 tensors), and only the tensors present in a
step's pseudo-gradient are touched, so a partial update (one block, one fragment) leaves
the other tensors' momentum as it was.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch

from fedgrid.aggregation.base import held
from fedgrid.aggregation.updates import compute_dtype, is_optimizable
from fedgrid.types import ModelState

__all__ = ["ServerOptimizer", "ServerSGD", "ServerAdam", "ServerYogi", "ServerAdagrad"]


class ServerOptimizer(ABC):
    """Moves the global model along a pseudo-gradient; its state checkpoints exactly.

    Args:
        lr: the server learning rate.

    Raises:
        ValueError: ``lr`` is not positive and finite.
    """

    kind: ClassVar[str] = ""
    #: Names of the per-tensor state buffers a subclass keeps (``momentum``, ``m``, ``v``).
    buffer_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, lr: float) -> None:
        if not (lr > 0 and lr != float("inf")):
            raise ValueError(f"server learning rate must be positive and finite, got {lr}")
        self.lr = float(lr)
        self.steps = 0
        self._buffers: dict[str, dict[str, torch.Tensor]] = {b: {} for b in self.buffer_names}

    def step(
        self, *, global_state: Mapping[str, torch.Tensor], pseudo_grad: Mapping[str, torch.Tensor]
    ) -> ModelState:
        """One server step.

        Args:
            global_state: the current global model (not modified).
            pseudo_grad: ``global - aggregate`` for some of the model's real floating tensors.

        Returns:
            The new global model: every tensor of ``global_state``, in order; those named in
            ``pseudo_grad`` updated (in their own dtype), the others the same objects.

        Raises:
            ValueError: a name is not in the model, a tensor is not real floating, or a
                shape differs from the model's.
        """
        for name, grad in pseudo_grad.items():
            _check_gradient(global_state, name, grad)
        out: ModelState = OrderedDict(global_state.items())
        for name, grad in pseudo_grad.items():
            out[name] = self._apply(global_state[name], name, grad)
        self.steps += 1
        return out

    def step_each(
        self,
        *,
        global_state: Mapping[str, torch.Tensor],
        names: Sequence[str],
        pseudo_grad_of: Callable[[str], torch.Tensor],
    ) -> ModelState:
        """``step`` with each tensor's pseudo-gradient made when its turn comes (``pseudo_grad_of(name)``)
        and dropped once applied: one tensor's pseudo-gradient in memory at a time, not the model's.

        Raises:
            ValueError: as ``step``. An error part way (or one ``pseudo_grad_of`` raises) leaves the
                buffers of the tensors before it stepped: the caller goes back to its state before
                the step (the round engine does, ``RoundEngine.run_round``).
        """
        out: ModelState = OrderedDict(global_state.items())
        for name in names:
            grad = pseudo_grad_of(name)
            _check_gradient(global_state, name, grad)
            out[name] = self._apply(global_state[name], name, grad)
            del grad
        self.steps += 1
        return out

    def _apply(self, ref: torch.Tensor, name: str, grad: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(ref.dtype)
        return self._update(name, ref.detach().to(dtype), grad.detach().to(ref.device, dtype)).to(ref.dtype)

    @abstractmethod
    def _update(self, name: str, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The new value of tensor ``name``; may update this tensor's buffers in place."""

    def reset(self) -> None:
        """Forgets all state (a fresh run)."""
        self.steps = 0
        self._buffers = {b: {} for b in self.buffer_names}

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state: plain dicts, ints and tensors (copies, except inside
        ``Strategy.state_view``: ``base.held``), safe for ``torch.save``."""
        return {
            "kind": self.kind,
            "steps": self.steps,
            "buffers": {b: {n: held(t) for n, t in per.items()} for b, per in self._buffers.items()},
        }

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raises ``ValueError`` unless ``state`` is a ``state_dict()`` of this kind of optimizer."""
        if state.get("kind") != self.kind:
            raise ValueError(
                f"optimizer state is of kind {state.get('kind')!r}, this optimizer is {self.kind!r}"
            )
        buffers = state.get("buffers", {})
        if set(buffers) != set(self.buffer_names) or "steps" not in state:
            raise ValueError(
                f"optimizer state holds buffers {sorted(buffers)}, expected {sorted(self.buffer_names)}"
            )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores ``state_dict()``'s output; hyperparameters stay those given to the constructor.

        Raises:
            ValueError: ``state`` belongs to another kind of optimizer.
        """
        self.check_state_dict(state)
        buffers = state["buffers"]
        self.steps = int(state["steps"])
        self._buffers = {b: {n: t.detach().clone() for n, t in buffers[b].items()} for b in self.buffer_names}


class ServerSGD(ServerOptimizer):
    """SGD on the pseudo-gradient, with optional (Nesterov) momentum; as ``torch.optim.SGD``.

    Args:
        lr: server learning rate (1.0 without momentum is FedAvg).
        momentum: momentum factor ``mu`` in [0, 1); 0 keeps no state.
        nesterov: Nesterov momentum (needs ``momentum > 0``).

    Raises:
        ValueError: an argument is out of range.
    """

    kind = "sgd"
    buffer_names = ("momentum",)

    def __init__(self, *, lr: float = 1.0, momentum: float = 0.0, nesterov: bool = False) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"server momentum must be in [0, 1), got {momentum}")
        if nesterov and momentum == 0.0:
            raise ValueError("Nesterov momentum needs momentum > 0")
        super().__init__(lr=lr)
        self.momentum = float(momentum)
        self.nesterov = nesterov

    def _update(self, name: str, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        if self.momentum > 0:
            bufs = self._buffers["momentum"]
            buf = bufs.get(name)
            if buf is None:
                buf = bufs[name] = grad.clone()
            else:
                buf.mul_(self.momentum).add_(grad)
            grad = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
        return param.add(grad, alpha=-self.lr)


class _AdaptiveOptimizer(ServerOptimizer):
    """Reddi et al.'s Algorithm 2 with the second-moment rule left to subclasses."""

    buffer_names = ("m", "v")

    def __init__(self, *, lr: float, beta1: float, beta2: float, tau: float) -> None:
        super().__init__(lr=lr)
        if not 0.0 <= beta1 < 1.0:
            raise ValueError(f"beta1 must be in [0, 1), got {beta1}")
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"beta2 must be in [0, 1), got {beta2}")
        if not (tau > 0 and tau != float("inf")):
            raise ValueError(f"tau must be positive and finite, got {tau}")
        self.beta1, self.beta2, self.tau = float(beta1), float(beta2), float(tau)

    @abstractmethod
    def _second_moment(self, v: torch.Tensor, grad_sq: torch.Tensor) -> None:
        """Updates ``v`` in place from the squared pseudo-gradient."""

    def _update(self, name: str, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        m = self._buffers["m"].get(name)
        if m is None:
            m = self._buffers["m"][name] = torch.zeros_like(grad)
            self._buffers["v"][name] = torch.full_like(grad, self.tau**2)
        v = self._buffers["v"][name]
        m.mul_(self.beta1).add_(grad, alpha=1.0 - self.beta1)
        self._second_moment(v, grad * grad)
        return param.addcdiv(m, v.sqrt().add_(self.tau), value=-self.lr)


class ServerAdam(_AdaptiveOptimizer):
    """FedAdam's server optimizer (no bias correction, as in the paper).

    Args:
        lr: server learning rate ``eta``.
        beta1: first-moment decay.
        beta2: second-moment decay.
        tau: adaptivity degree; also the initial ``sqrt(v)``.
    """

    kind = "adam"

    def __init__(
        self, *, lr: float = 1e-2, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3
    ) -> None:
        super().__init__(lr=lr, beta1=beta1, beta2=beta2, tau=tau)

    def _second_moment(self, v: torch.Tensor, grad_sq: torch.Tensor) -> None:
        v.mul_(self.beta2).add_(grad_sq, alpha=1.0 - self.beta2)


class ServerYogi(_AdaptiveOptimizer):
    """FedYogi's server optimizer: ``v`` moves toward ``g**2`` by at most ``(1 - beta2) * g**2``.

    Args: as ``ServerAdam``.
    """

    kind = "yogi"

    def __init__(
        self, *, lr: float = 1e-2, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3
    ) -> None:
        super().__init__(lr=lr, beta1=beta1, beta2=beta2, tau=tau)

    def _second_moment(self, v: torch.Tensor, grad_sq: torch.Tensor) -> None:
        v.sub_(grad_sq * torch.sign(v - grad_sq), alpha=1.0 - self.beta2)


class ServerAdagrad(_AdaptiveOptimizer):
    """FedAdagrad's server optimizer: ``v`` sums ``g**2``.

    Args:
        lr: server learning rate ``eta``.
        beta1: first-moment decay; the default 0 is classic Adagrad (the paper's Algorithm 2
            allows any value in [0, 1)).
        tau: adaptivity degree; also the initial ``sqrt(v)``.
    """

    kind = "adagrad"

    def __init__(self, *, lr: float = 1e-1, beta1: float = 0.0, tau: float = 1e-3) -> None:
        super().__init__(lr=lr, beta1=beta1, beta2=0.0, tau=tau)

    def _second_moment(self, v: torch.Tensor, grad_sq: torch.Tensor) -> None:
        v.add_(grad_sq)


def _check_gradient(global_state: Mapping[str, torch.Tensor], name: str, grad: torch.Tensor) -> None:
    """Raises ``ValueError`` unless ``grad`` is a pseudo-gradient of the model's real floating tensor ``name``."""
    ref = global_state.get(name)
    if ref is None:
        raise ValueError(f"pseudo-gradient names tensor '{name}', which the model does not hold")
    if not is_optimizable(ref.dtype):
        raise ValueError(f"tensor '{name}' has dtype {ref.dtype}: only real floating tensors are optimized")
    if grad.shape != ref.shape:
        raise ValueError(
            f"pseudo-gradient of '{name}' has shape {list(grad.shape)}, the model {list(ref.shape)}"
        )
