"""The client halves of FedAvg and its per-round variants: ``fedavg`` (also FedAvgM and FedOpt)
trains the whole model from the download, ``fedprox`` adds a proximal term's gradient at each
step, ``scaffold`` corrects each step's gradient with control variates and sends their deltas."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from fedgrid.client.algorithm_hooks import ClientAlgorithm, FitContext
from fedgrid.client.algorithm_math import ProximalTerm, ScaffoldControl
from fedgrid.types import ModelState

__all__ = ["FedAvgTraining", "FedProxTraining", "ScaffoldTraining"]


class FedAvgTraining(ClientAlgorithm):
    """``fedavg`` (also FedAvgM and FedOpt): the defaults, the whole model for ``local_epochs``."""

    name = "fedavg"


class FedProxTraining(ClientAlgorithm):
    """``fedprox``: the gradient of ``proximal_mu / 2 * ||w - w_global||^2`` added at each step."""

    name = "fedprox"
    not_batchable = None  # the batched engine puts proximal_mu's term in its objective

    def __init__(self) -> None:
        self._mu = 0.0
        self._term: ProximalTerm | None = None

    def proximal_mu(self, *, ctx: FitContext) -> float:
        mu = float(ctx.config.get("proximal_mu", 0.0))
        if not (mu >= 0 and mu != float("inf")):
            raise ValueError(f"proximal_mu must be non-negative and finite, got {mu}")
        return mu

    def begin(self, *, params: Mapping[str, nn.Parameter], ctx: FitContext) -> None:
        self._mu, self._term = self.proximal_mu(ctx=ctx), None

    def after_backward(self, *, params: Mapping[str, nn.Parameter]) -> None:
        if self._term is None:
            # Anchored at the first step, before the optimizer moved anything: the start state.
            # Not in begin, which the batched engine also calls, with parameters it does not train.
            self._term = ProximalTerm(list(params.values()), self._mu)
        self._term.add_gradients()

    def upload(self, *, state: ModelState, trained: Sequence[str], ctx: FitContext) -> ModelState:
        self._term = None
        return state


class ScaffoldTraining(ClientAlgorithm):
    """``scaffold``: gradients corrected by ``c - c_i``; uploads the model and the ``c_i`` deltas.

    Attributes:
        control: the client's ``ScaffoldControl`` (its ``c_i``), kept across rounds.
    """

    name = "scaffold"
    not_batchable = None  # the batched engine adds ``correction`` and reports to ``record``

    def __init__(self) -> None:
        self.control = ScaffoldControl()
        self._server: ModelState = OrderedDict()

    def start(self, *, download: ModelState, ctx: FitContext) -> ModelState:
        model, self._server = ScaffoldControl.split(download)
        return model

    def begin(self, *, params: Mapping[str, nn.Parameter], ctx: FitContext) -> None:
        self.control.begin(self._server, params)

    def after_backward(self, *, params: Mapping[str, nn.Parameter]) -> None:
        self.control.correct(params)

    @property
    def correction(self) -> Mapping[str, torch.Tensor]:
        return self.control.correction

    def record(self, *, name: str, grad_sum: torch.Tensor, count: int) -> None:
        self.control.record(name, grad_sum, count)

    def upload(self, *, state: ModelState, trained: Sequence[str], ctx: FitContext) -> ModelState:
        out = OrderedDict(state)
        out.update(self.control.finish(state))
        self._server = OrderedDict()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"scaffold": self.control.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.control = ScaffoldControl()
        if state.get("scaffold") is not None:
            self.control.load_state_dict(state["scaffold"])
