"""``FederatedCallback``: Lightning's ``Trainer`` as a federation client, with its own loop, data and
optimizer::

    from fedgrid.integrations.lightning import FederatedCallback

    trainer = L.Trainer(max_steps=10_000, callbacks=[FederatedCallback("coord.example.org:50051", name="site-a")])
    trainer.fit(module, loader)    # joins, pulls the global model, syncs on the coordinator's cadence, leaves

The coordinator serves the same module's state: ``fedgrid coordinator --model MODULE:FACTORY`` with
a factory that builds the ``LightningModule`` (its ``state_dict`` names are the wire's; ``prefix``
or ``module`` say otherwise). What happens at train begin, at each optimizer step and at train end
is ``fedgrid.integrations.federation``'s; under DDP one rank talks to the coordinator. Needs the
``lightning`` extra.
"""

from __future__ import annotations

import math
import os
from typing import Any

import lightning as L
from torch import nn

from fedgrid.integrations.federation import Connector, Federation, connector

__all__ = ["FederatedCallback"]


class FederatedCallback(L.Callback):  # type: ignore[misc]  # lightning's classes are untyped for mypy
    """A Lightning ``Callback`` that makes the trainer a client of ``coordinator``.

    Args:
        coordinator: ``HOST:PORT`` (``fedgrid client``'s first argument), or a simulated
            client's connection (``fedgrid.integrations.simulated.TrainerClient.connector``).
        name, region, ca, cert, key, server_name, state_dir: as ``fedgrid client``'s options.
        steps_per_round: optimizer steps of a FedAvg round (0: ``local_epochs`` of the trainer's epochs).
        num_examples: examples this site holds, reported at join (0: the training set's length).
        module: what is synced (default: the ``LightningModule``).
        prefix: the synced module's tensor names on the coordinator (``""``: as they are).
        options: more of ``fedgrid.client.connect``'s options.
    """

    def __init__(
        self,
        coordinator: str | Connector,
        *,
        name: str = "",
        region: str = "",
        ca: str = "",
        cert: str = "",
        key: str = "",
        server_name: str = "",
        state_dir: str | os.PathLike[str] | None = None,
        steps_per_round: int = 0,
        num_examples: int = 0,
        module: nn.Module | None = None,
        prefix: str = "",
        **options: Any,
    ) -> None:
        join = connector(
            coordinator,
            name=name,
            region=region,
            ca=ca,
            cert=cert,
            key=key,
            server_name=server_name,
            state_dir=state_dir,
            options=options,
        )
        self.federation = Federation(
            join, prefix=prefix, steps_per_round=steps_per_round, num_examples=num_examples
        )
        self._module = module
        self._steps_seen = 0
        self._loss: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader = trainer.train_dataloader
        accumulation = max(int(trainer.accumulate_grad_batches), 1)
        batches = int(trainer.num_training_batches) if math.isfinite(trainer.num_training_batches) else 0
        batch_size = int(getattr(loader, "batch_size", None) or 1)
        dataset = getattr(loader, "dataset", None)
        held = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else 0
        self._steps_seen = trainer.global_step
        self.federation.begin(
            self._module if self._module is not None else pl_module,
            steps_per_epoch=math.ceil(batches / accumulation),
            examples_per_step=batch_size * accumulation * int(trainer.world_size),
            num_examples=held,
        )

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        self.federation.after_backward()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None and hasattr(loss, "item"):
            self._loss = float(loss.item())
        if trainer.global_step == self._steps_seen:  # accumulating: no optimizer step yet
            return
        self._steps_seen = trainer.global_step
        loss, self._loss = self._loss, None
        if not self.federation.step(loss=loss):
            trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.federation.end()
