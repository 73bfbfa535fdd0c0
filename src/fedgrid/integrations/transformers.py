"""``FederatedCallback``: Hugging Face's ``Trainer`` (and TRL's ``SFTTrainer``, a ``Trainer``) as a
federation client, with its own loop, data, optimizer and schedule::

    from fedgrid.integrations.transformers import FederatedCallback

    trainer = SFTTrainer(model=model, args=args, train_dataset=data, peft_config=lora,
                         callbacks=[FederatedCallback("coord.example.org:50051", name="site-a")])
    trainer.train()      # joins, pulls the global adapters, syncs on the coordinator's cadence, leaves

The coordinator serves the same model: ``fedgrid coordinator --model hf:PATH`` (``--peft
lora:r=...,targets=...`` for a ``PeftModel``: only the adapters travel, and a client whose frozen
base differs is refused at train begin, both hashes named). What happens at train begin, at each
step and at train end is ``fedgrid.integrations.federation``'s. Under ``accelerate launch`` with
several processes one rank talks to the coordinator and broadcasts what it receives.

Set the trainer's ``max_steps`` (or epochs) to at least the run's rounds times the steps of a
round: the coordinator's end stops the trainer first. Needs the ``transformers`` extra.
"""

from __future__ import annotations

import math
import os
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from fedgrid.integrations.federation import Connector, Federation, connector

__all__ = ["FederatedCallback"]


class FederatedCallback(TrainerCallback):  # type: ignore[misc]  # transformers is untyped for mypy
    """A ``TrainerCallback`` that makes the trainer a client of ``coordinator``.

    Args:
        coordinator: ``HOST:PORT`` (``fedgrid client``'s first argument), or a simulated
            client's connection (``fedgrid.integrations.simulated.TrainerClient.connector``).
        name, region: labels sent at join.
        ca, cert, key: PEM files for mutual TLS (all three or none).
        server_name: the name the coordinator's certificate holds, when not the host.
        state_dir: where the client's state is kept across restarts (``fedgrid client --state-dir``).
        steps_per_round: optimizer steps of a FedAvg round (0: ``local_epochs`` of the
            trainer's epochs); DiLoCo's ``inner_steps`` always decide.
        num_examples: examples this site holds, reported at join (0: the training set's length).
        prefix: the model's tensor names on the coordinator (``net.``: ``--model hf:PATH``'s).
        options: more of ``fedgrid.client.connect``'s options (``connect_timeout``, ``rpc_timeout``,
            ``verbose``, ``on_task``).

    Attributes:
        federation: the client (``fedgrid.integrations.federation.Federation``): ``rounds``,
            ``finished``.
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
        prefix: str = "net.",
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
        self._loss: float | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        loader = kwargs.get("train_dataloader")
        batches = len(loader) if loader is not None and hasattr(loader, "__len__") else 0
        accumulation = max(int(args.gradient_accumulation_steps), 1)
        dataset = getattr(loader, "dataset", None)
        held = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else 0
        self.federation.begin(
            kwargs["model"],
            steps_per_epoch=math.ceil(batches / accumulation),
            examples_per_step=int(args.per_device_train_batch_size) * accumulation * int(args.world_size),
            num_examples=held,
        )

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.federation.after_backward()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs and "loss" in logs:
            self._loss = float(logs["loss"])

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        loss, self._loss = self._loss, None
        if not self.federation.step(loss=loss):
            control.should_training_stop = True

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.federation.end()
