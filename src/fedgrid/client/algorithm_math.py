"""State and arithmetic on tensors that the client algorithms (``fedgrid.client.algorithms``) use.

No training loop here: the algorithms' hooks call these, and trainers call the hooks. Tensors
added to a gradient are made with ``like``, so on sharded parameters (FSDP2's ``DTensor``)
they are sharded the same way and every operation stays elementwise on the local shard.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from fedgrid.aggregation.blocks import matches_prefix, parse_row_slice
from fedgrid.aggregation.scaffold import CONTROL_DELTA_PREFIX, CONTROL_PREFIX
from fedgrid.types import ModelState

__all__ = ["ProximalTerm", "ScaffoldControl", "full", "like", "merge", "names_under", "rows_of", "train_only"]


def _is_dtensor(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def like(full_tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full_tensor`` (the whole, unsharded value) on ``param``'s device and in its dtype, and
    distributed as ``param`` is: a ``DTensor`` with its mesh and placements when ``param`` is
    one (FSDP2), cut locally, as every rank holds the same ``full_tensor``."""
    local = full_tensor.to(param.device, param.dtype)
    if _is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)  # type: ignore[attr-defined]
    return local


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of ``t``: gathered from every rank when it is a sharded ``DTensor`` (a collective)."""
    return t.full_tensor() if _is_dtensor(t) else t  # type: ignore[attr-defined]


def names_under(names: Sequence[str], prefixes: str, *, key: str) -> list[str]:
    """The ``names`` under any of the comma-joined ``prefixes`` (``blocks.matches_prefix``), in
    order; a prefix that is a row slice of one of ``names`` (``blocks.row_slice_name``, streaming
    DiLoCo's fragments) is itself in the result, in the place of its tensor.

    Raises:
        ValueError: no prefix given, or they match no tensor (``key`` names the config key).
    """
    wanted = [p.strip() for p in prefixes.split(",") if p.strip()]
    if not wanted:
        raise ValueError(f"task config '{key}' names no tensor prefix")
    slices: dict[str, list[tuple[int, str]]] = {}
    for prefix in wanted:
        part = parse_row_slice(prefix)
        if part is not None:
            slices.setdefault(part[0], []).append((part[1], prefix))
    out: list[str] = []
    for name in names:
        if any(matches_prefix(name, p) for p in wanted):
            out.append(name)
        out.extend(prefix for _, prefix in sorted(slices.get(name, ())))
    if not out:
        raise ValueError(f"task config '{key}' = {prefixes!r} matches no tensor of the model")
    return out


def rows_of(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """Tensor ``name`` of ``state``, or for a row slice name (``blocks.row_slice_name``) a copy of
    those rows of its tensor.

    Raises:
        ValueError: a row slice outside its tensor's rows.
    """
    part = parse_row_slice(name)
    if part is None:
        return state[name]
    whole, start, stop = part
    tensor = state[whole]
    if not 0 <= start < stop <= tensor.shape[0]:
        raise ValueError(f"row slice '{name}' is outside the {tensor.shape[0]} rows of tensor '{whole}'")
    return tensor[start:stop].clone()


def merge(local: ModelState, download: ModelState, names: Sequence[str], alpha: float) -> ModelState:
    """``local`` with the tensors ``names`` merged from ``download``: ``alpha * local + (1 - alpha) *
    download`` for floating tensors, the downloaded value for the others (integer buffers such
    as batch norm's counter) and for every tensor when ``alpha`` is 0 (a plain replace, bit for
    bit). A row slice name (``blocks.row_slice_name``) merges those rows of its tensor alone,
    with the same bits as a merge of the whole tensor gives them. The result holds new
    tensors where it merged, ``local``'s elsewhere (``local`` is not modified).

    Args:
        local: the worker's replica, by name.
        download: the global values, holding every one of ``names``.
        names: the tensors (or row slices) to merge, in any order.
        alpha: the share of the local value kept, in [0, 1].

    Raises:
        ValueError: ``alpha`` outside [0, 1], or a row slice whose rows are not its tensor's.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"merge alpha must be in [0, 1], got {alpha}")
    out = OrderedDict(local)
    for name in names:
        part, theirs = parse_row_slice(name), download[name]
        if part is None:
            out[name] = _mixed(local[name], theirs, alpha)
            continue
        whole, start, stop = part
        mine = local[whole][start:stop]
        if theirs.shape != mine.shape:
            raise ValueError(
                f"cannot merge '{name}': the download holds shape {list(theirs.shape)}, the replica's rows {list(mine.shape)}"
            )
        if out[whole] is local[whole]:  # the first of its rows merged: a copy of the replica's tensor
            out[whole] = local[whole].clone()
        out[whole][start:stop] = _mixed(mine, theirs, alpha)
    return out


def _mixed(mine: torch.Tensor, theirs: torch.Tensor, alpha: float) -> torch.Tensor:
    """``merge``'s value of one tensor: ``theirs`` when ``alpha`` is 0 or it is not floating,
    else ``alpha * mine + (1 - alpha) * theirs`` in ``mine``'s dtype."""
    if alpha == 0.0 or not theirs.is_floating_point():
        return theirs
    return torch.lerp(theirs.to(mine.dtype), mine, alpha)


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
        self._scales: dict[torch.dtype, float] = {}

    def _scale(self, dtype: torch.dtype) -> float:
        """``2 g``, ``g`` the gradient autograd sends back to ``term()``: ``mu / 2`` multiplied in ``dtype``."""
        if dtype not in self._scales:
            self._scales[dtype] = 2.0 * float(torch.ones((), dtype=dtype) * (0.5 * self.mu))
        return self._scales[dtype]

    def __call__(self) -> torch.Tensor:
        total = sum(((p - a) ** 2).sum() for p, a in zip(self.params, self.anchor))
        return 0.5 * self.mu * torch.as_tensor(total)

    @torch.no_grad()
    def add_gradients(self) -> None:
        """Adds the term's gradient ``mu * (w - w_global)`` to each parameter's ``.grad``.

        Bit for bit what back-propagating ``loss + term()`` adds: autograd computes
        ``g * 2 (w - w_global)`` with ``g`` = ``mu / 2`` rounded to the parameter's dtype, the
        same product as ``2 g * (w - w_global)`` rounded once, and a sum of two gradients is
        the same in either order. Only a parameter the loss uses more than once (tied
        weights) can differ in the last bit: autograd sums its loss gradients after the
        term's. Elementwise, so it runs on sharded parameters after their gradients are reduced.
        """
        for p, a in zip(self.params, self.anchor):
            step = (p - a).mul_(self._scale(p.dtype))
            if p.grad is None:
                p.grad = step
            else:
                p.grad.add_(step)


class ScaffoldControl:
    """SCAFFOLD's client control variate ``c_i``, kept across rounds (zero at first).

    Per round: ``begin`` with the server's ``c``, ``correct`` after each backward pass,
    ``finish`` for the ``scaffold.c_delta.<name>`` tensors to upload.

    The new ``c_i`` is the mean of the uncorrected minibatch gradients of the round: the
    paper's option I evaluated along the local trajectory instead of at the global model.
    Option II (``(x - y_i) / (K * lr)``) assumes plain SGD; with momentum or Adam, which
    the built-in clients use, it misestimates the gradient by the optimizer's gain.

    On sharded parameters the corrections and gradient sums are sharded like them, and
    ``finish`` gathers the sums (a collective every rank calls).
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
        model: ModelState = OrderedDict(
            (n, t) for n, t in download.items() if not n.startswith(CONTROL_PREFIX)
        )
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
        self._server = OrderedDict(
            (n, c.detach().to("cpu", torch.float32)) for n, c in server_control.items()
        )
        for name, c in self._server.items():
            if name not in self.c_i or self.c_i[name].shape != c.shape:
                self.c_i[name] = torch.zeros_like(c)
        self._correction = {
            n: like(self._server[n] - self.c_i[n], p) for n, p in params.items() if n in self._server
        }
        # zeros_like: sharded like the parameter when it is a DTensor
        self._grad_sums = {
            n: torch.zeros_like(params[n], dtype=torch.float32, memory_format=torch.contiguous_format)
            for n in self._correction
        }
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
            new = full(self._grad_sums[name]).cpu() / count if count else old
            deltas[CONTROL_DELTA_PREFIX + name] = (new - old).to(model[name].dtype)
            self.c_i[name] = new.clone()
        self._correction, self._grad_sums, self._counts = {}, {}, {}
        return deltas

    def state_dict(self) -> dict[str, Any]:
        return {"c_i": OrderedDict((n, c.clone()) for n, c in self.c_i.items())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.c_i = OrderedDict(
            (n, c.detach().to("cpu", torch.float32).clone()) for n, c in state["c_i"].items()
        )


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
            own = [
                f"{prefix}.{n}" if prefix else n
                for n, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            ]
            if own and not any(n in chosen for n in own):
                module.eval()
        yield [p for p in params.values() if p.requires_grad]
    finally:
        for n, p in params.items():
            p.requires_grad_(saved[n])
