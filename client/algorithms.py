"""The client halves of the training algorithms, selected by the task's ``algorithm`` key.

The server half of each lives in ``fedgrid.aggregation``; it tells clients what to do
through the task config only, so a client reached over gRPC (which sees the config, not
the server-side ``FitIns.expected``) sends exactly the tensors its task declares:

- ``fedavg`` (no ``algorithm`` key: FedAvg and the FedOpt family): train the whole model
  for ``local_epochs``, send the model.
- ``fedprox``: as ``fedavg`` with ``proximal_mu / 2 * ||w - w_global||^2`` added to the loss.
- ``scaffold``: the download holds ``scaffold.c.<name>`` tensors (the server control
  variate) besides the model; each step's gradient is corrected by ``c - c_i``; the upload
  is the model plus ``scaffold.c_delta.<name>`` for every control tensor.
- ``diloco``: ``inner_steps`` steps of a persistent inner optimizer (AdamW by default).
- ``streaming-diloco``: as ``diloco`` on a local replica kept across rounds; only the
  ``merge_fragment_prefixes`` tensors are taken from the download, only the
  ``fragment_prefixes`` tensors are sent.
- ``bcd``: only the ``block_prefixes`` tensors train (the rest frozen, their modules in
  eval mode so their buffers stay as downloaded) and only they are sent.

Everything here is state and arithmetic on tensors; ``TorchClient`` runs the loop.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from fedgrid.aggregation.blocks import matches_prefix
from fedgrid.aggregation.scaffold import CONTROL_DELTA_PREFIX, CONTROL_PREFIX
from fedgrid.types import ModelState, Scalar

__all__ = [
    "ALGORITHMS",
    "STEP_ALGORITHMS",
    "algorithm_of",
    "names_under",
    "ProximalTerm",
    "ScaffoldControl",
    "train_only",
]

#: ``algorithm`` values a ``TorchClient`` understands (absent means ``fedavg``).
ALGORITHMS = ("fedavg", "fedprox", "scaffold", "diloco", "streaming-diloco", "bcd")
#: Algorithms that run ``inner_steps`` optimizer steps instead of ``local_epochs`` epochs.
STEP_ALGORITHMS = ("diloco", "streaming-diloco")


def algorithm_of(config: Mapping[str, Scalar]) -> str:
    """The task's algorithm (``fedavg`` when the config names none).

    Raises:
        ValueError: an algorithm this client does not implement.
    """
    name = str(config.get("algorithm", "fedavg"))
    if name not in ALGORITHMS:
        raise ValueError(f"task asks for algorithm {name!r}; this client implements {', '.join(ALGORITHMS)}")
    return name


def names_under(names: Sequence[str], prefixes: str, *, key: str) -> list[str]:
    """The ``names`` under any of the comma-joined ``prefixes`` (``blocks.matches_prefix``), in order.

    Raises:
        ValueError: no prefix given, or they match no tensor (``key`` names the config key).
    """
    wanted = [p.strip() for p in prefixes.split(",") if p.strip()]
    if not wanted:
        raise ValueError(f"task config '{key}' names no tensor prefix")
    out = [n for n in names if any(matches_prefix(n, p) for p in wanted)]
    if not out:
        raise ValueError(f"task config '{key}' = {prefixes!r} matches no tensor of the model")
    return out


class ProximalTerm:
    """FedProx's ``mu / 2 * sum ||w - w_global||^2`` over ``params``, anchored at their values now.

    Args:
        params: the trainable parameters, just loaded with the global model.
        mu: the proximal coefficient (``proximal_mu`` of the task).
    """

    def __init__(self, params: Sequence[nn.Parameter], mu: float) -> None:
        if not (mu >= 0 and mu != float("inf")):
            raise ValueError(f"proximal_mu must be non-negative and finite, got {mu}")
        self.mu = float(mu)
        self.params = list(params)
        self.anchor = [p.detach().clone() for p in self.params]

    def __call__(self) -> torch.Tensor:
        total = sum(((p - a) ** 2).sum() for p, a in zip(self.params, self.anchor))
        return 0.5 * self.mu * torch.as_tensor(total)


class ScaffoldControl:
    """SCAFFOLD's client control variate ``c_i``, kept across rounds (zero at first).

    Per round: ``begin`` with the server's ``c``, ``correct`` after each backward pass,
    ``finish`` for the ``scaffold.c_delta.<name>`` tensors to upload.

    The new ``c_i`` is the mean of the uncorrected minibatch gradients of the round: the
    paper's option I evaluated along the local trajectory instead of at the global model.
    Option II (``(x - y_i) / (K * lr)``) assumes plain SGD; with momentum or Adam, which
    the built-in clients use, it misestimates the gradient by the optimizer's gain.
    """

    def __init__(self) -> None:
        self.c_i: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        self._server: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        self._correction: dict[str, torch.Tensor] = {}
        self._grad_sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}

    @staticmethod
    def split(download: Mapping[str, torch.Tensor]) -> tuple[ModelState, ModelState]:
        """Splits a SCAFFOLD download into (model, server control variate by model name).

        Raises:
            ValueError: a control tensor names no model tensor, or has another shape.
        """
        model: ModelState = OrderedDict((n, t) for n, t in download.items() if not n.startswith(CONTROL_PREFIX))
        control: ModelState = OrderedDict()
        for name, tensor in download.items():
            if name.startswith(CONTROL_PREFIX):
                target = name[len(CONTROL_PREFIX) :]
                if target not in model or model[target].shape != tensor.shape:
                    raise ValueError(f"control variate '{name}' matches no model tensor of its shape")
                control[target] = tensor
        return model, control

    def begin(self, server_control: Mapping[str, torch.Tensor], params: Mapping[str, nn.Parameter]) -> None:
        """Starts a round: the gradient of parameter ``n`` will be corrected by ``c[n] - c_i[n]``."""
        self._server = OrderedDict((n, c.detach().to("cpu", torch.float32)) for n, c in server_control.items())
        for name, c in self._server.items():
            if name not in self.c_i or self.c_i[name].shape != c.shape:
                self.c_i[name] = torch.zeros_like(c)
        self._correction = {n: (self._server[n] - self.c_i[n]).to(p.device, p.dtype) for n, p in params.items() if n in self._server}
        self._grad_sums = {n: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for n in self._correction for p in [params[n]]}
        self._counts = {n: 0 for n in self._correction}

    def correct(self, params: Mapping[str, nn.Parameter]) -> None:
        """After a backward pass: records the raw gradients, then adds ``c - c_i`` to them."""
        for name, correction in self._correction.items():
            grad = params[name].grad
            if grad is None:
                continue
            self._grad_sums[name] += grad.detach().float()
            self._counts[name] += 1
            grad.add_(correction)

    @property
    def correction(self) -> Mapping[str, torch.Tensor]:
        """Between ``begin`` and ``finish``: ``c - c_i`` by parameter name (what ``correct`` adds)."""
        return dict(self._correction)

    def record(self, name: str, grad_sum: torch.Tensor, count: int) -> None:
        """Records ``count`` raw gradients of ``name`` summed in ``grad_sum`` (float32), as ``count``
        calls of ``correct`` would; for engines that correct gradients themselves."""
        self._grad_sums[name] += grad_sum.to(self._grad_sums[name].device)
        self._counts[name] += count

    def finish(self, model: Mapping[str, torch.Tensor]) -> ModelState:
        """Ends a round: updates ``c_i``; returns ``scaffold.c_delta.<name>`` (in ``model``'s dtypes).

        A control tensor without gradients this round (a buffer, a frozen or unused
        parameter) keeps its ``c_i``: its delta is zero.
        """
        deltas: ModelState = OrderedDict()
        for name in self._server:
            old = self.c_i[name]
            count = self._counts.get(name, 0)
            new = self._grad_sums[name].cpu() / count if count else old
            deltas[CONTROL_DELTA_PREFIX + name] = (new - old).to(model[name].dtype)
            self.c_i[name] = new.clone()
        self._correction, self._grad_sums, self._counts = {}, {}, {}
        return deltas

    def state_dict(self) -> dict[str, Any]:
        return {"c_i": OrderedDict((n, c.clone()) for n, c in self.c_i.items())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.c_i = OrderedDict((n, c.detach().to("cpu", torch.float32).clone()) for n, c in state["c_i"].items())


@contextmanager
def train_only(model: nn.Module, names: Sequence[str]) -> Iterator[list[nn.Parameter]]:
    """Within the block, only the parameters ``names`` train; yields the trainable ones.

    Every other parameter has ``requires_grad`` off (no gradient, no optimizer state), and
    modules whose own tensors all lie outside ``names`` are in eval mode, so their buffers
    (BatchNorm statistics) stay as downloaded. ``requires_grad`` is restored on exit.
    """
    chosen = set(names)
    params = OrderedDict(model.named_parameters())
    saved = {n: p.requires_grad for n, p in params.items()}
    try:
        for n, p in params.items():
            p.requires_grad_(saved[n] and n in chosen)  # a parameter the user froze stays frozen
        for prefix, module in model.named_modules():
            own = [f"{prefix}.{n}" if prefix else n for n, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]]
            if own and not any(n in chosen for n in own):
                module.eval()
        yield [p for p in params.values() if p.requires_grad]
    finally:
        for n, p in params.items():
            p.requires_grad_(saved[n])
