"""``TorchClient``: a ``Client`` built from an ``nn.Module``, a data loader, a loss and an optimizer factory."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Mapping

import torch
from torch import nn

from fedgrid.client.api import Client, EvaluateOutput, FitOutput
from fedgrid.seeding import derive_seed
from fedgrid.types import FitIns, ModelState, Scalar

__all__ = ["TorchClient", "default_device"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def default_device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TorchClient(Client):
    """Trains ``model`` on ``train_loader`` for the epochs a task asks.

    Task config keys it reads: ``local_epochs`` (default 1), ``lr`` (overrides the
    optimizer's learning rate), ``round`` and ``seed`` (with this client's own ``seed`` and
    ``name`` they seed shuffling and dropout, so a run is reproducible in any process).

    Args:
        model: the module; its ``state_dict`` is what travels.
        train_loader: an iterable of ``(inputs, targets)`` batches.
        loss_fn: ``loss_fn(outputs, targets) -> scalar tensor``.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer``, called at each fit.
        eval_loader: batches for ``evaluate``; defaults to none (evaluate raises).
        device: where to train; CUDA when present by default.
        seed: this client's seed.
        name: stable label (see ``Client.name``).
        region: region label.
    """

    def __init__(
        self,
        model: nn.Module,
        train_loader: Iterable,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        optimizer: OptimizerFactory,
        *,
        eval_loader: Iterable | None = None,
        device: torch.device | str | None = None,
        seed: int = 0,
        name: str = "",
        region: str = "",
    ) -> None:
        self.device = torch.device(device) if device is not None else default_device()
        self.model = model.to(self.device)
        self.train_loader = train_loader
        self.loss_fn = loss_fn
        self.optimizer_factory = optimizer
        self.eval_loader = eval_loader
        self.seed = seed
        self.name = name
        self.region = region

    @property
    def num_examples(self) -> int:
        dataset = getattr(self.train_loader, "dataset", None)
        return len(dataset) if dataset is not None else 0

    def _load(self, state: ModelState) -> None:
        self.model.load_state_dict(state, strict=True)

    def _state(self) -> ModelState:
        return OrderedDict((k, v.detach().to("cpu").clone()) for k, v in self.model.state_dict().items())

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        config = ins.config
        epochs = int(config.get("local_epochs", 1))
        if epochs < 1:
            raise ValueError(f"local_epochs must be at least 1, got {epochs}")
        self._load(state)
        optimizer = self.optimizer_factory(self.model.parameters())
        if "lr" in config:
            for group in optimizer.param_groups:
                group["lr"] = float(config["lr"])
        seed = derive_seed(config.get("seed", 0), ins.round, self.seed, self.name)
        total_loss, seen = 0.0, 0
        self.model.train()
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            for _ in range(epochs):
                for inputs, targets in self.train_loader:
                    inputs, targets = inputs.to(self.device), targets.to(self.device)
                    optimizer.zero_grad(set_to_none=True)
                    loss = self.loss_fn(self.model(inputs), targets)
                    loss.backward()
                    optimizer.step()
                    total_loss += float(loss.detach()) * len(targets)
                    seen += len(targets)
        if seen == 0:
            raise ValueError(f"client {self.name!r} has no training data")
        return FitOutput(state=self._state(), num_examples=seen // epochs, metrics={"loss": total_loss / seen})

    @torch.no_grad()
    def evaluate(self, state: ModelState, config: Mapping[str, Scalar]) -> EvaluateOutput:
        if self.eval_loader is None:
            raise NotImplementedError(f"client {self.name!r} has no evaluation data")
        self._load(state)
        self.model.eval()
        total_loss, correct, seen = 0.0, 0, 0
        classification = True
        for inputs, targets in self.eval_loader:
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            outputs = self.model(inputs)
            total_loss += float(self.loss_fn(outputs, targets)) * len(targets)
            # Accuracy is defined only for class scores against integer labels.
            classification = classification and outputs.dim() == 2 and targets.dim() == 1 and not targets.is_floating_point()
            if classification:
                correct += int((outputs.argmax(dim=1) == targets).sum())
            seen += len(targets)
        metrics = {"loss": total_loss / max(seen, 1)}
        if seen and classification:
            metrics["accuracy"] = correct / seen
        return EvaluateOutput(num_examples=seen, metrics=metrics)
