"""What the batched engine knows of a model and of the clients that train it.

``describe_model`` reads a model's parameters, buffers and tied weights into a ``ModelLayout``;
``check_batchable_modules`` and ``recurrent_module`` say which models cannot (or should not) batch;
``per_example_loss`` turns a client's loss into per-example losses, so padded batches change
nothing. Part of the batched engine (``fedgrid.simulation.batched``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.func import vmap
from torch.utils.data import TensorDataset

from fedgrid.client.api import Client
from fedgrid.client.loaders import PlainLoader
from fedgrid.client.torch_client import TorchClient
from fedgrid.simulation.batched_optim import NotBatchable

__all__ = [
    "ClientStatic",
    "ModelLayout",
    "TORCH_CLIENT_METHODS",
    "check_batchable_modules",
    "describe_model",
    "loader_size",
    "loss_key_of",
    "per_example_loss",
    "recurrent_module",
]

#: The methods of ``TorchClient`` a batched client must not override (its training runs them batched).
TORCH_CLIENT_METHODS = (
    "fit",
    "algorithm",
    "_train",
    "_batches",
    "_load",
    "_state",
    "_training_module",
    "_batch_loss",
    "_reduce_totals",
    "round_seed",
)


def recurrent_module(clients: Sequence[Client]) -> str | None:
    """Why ``auto`` should not batch ``clients``: their first recurrent module, or ``None``.

    ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` (``nn.RNNBase``) run fused kernels (on CPU
    ``aten::mkldnn_rnn_layer``) for which ``torch.func.vmap`` has no batching rule: it warns
    and falls back to a loop over the stacked clients, slower than the sequential engine,
    so ``auto`` does not even try a batched step (which would print the warning).
    """
    seen: set[int] = set()
    for client in clients:
        model = getattr(client, "model", None) if isinstance(client, TorchClient) else None
        if model is None or id(model) in seen:
            continue
        seen.add(id(model))
        for name, module in model.named_modules():
            if isinstance(module, nn.RNNBase):
                where = f" '{name}'" if name else ""
                return (
                    f"the model has a recurrent module{where} ({type(module).__name__}), which torch.func.vmap "
                    "runs through a slow per-client fallback"
                )
    return None


@dataclass
class ModelLayout:
    """A model architecture shared by clients: the template module ``functional_call`` runs."""

    template: nn.Module
    device: torch.device
    state_keys: list[str]  # state_dict keys, in order
    canonical: dict[str, str]  # state key -> the parameter/buffer name functional_call takes (tied weights)
    params: list[str]  # canonical names of the parameters that train (requires_grad)
    frozen_params: list[str]  # canonical parameters the user froze (requires_grad False)
    buffers: list[str]  # persistent buffers
    dtypes: dict[str, torch.dtype]
    shapes: dict[str, tuple[int, ...]]  # by state key
    state_bytes: int = 0
    activation_bytes: int = 0  # one client's batch: outputs of every leaf module
    largest_bytes: int = 0  # one client's largest tensor: a parameter or a leaf module's output
    conv_share: float = 0.0


@dataclass
class ClientStatic:
    """What a client brings that does not change between rounds."""

    index: int
    client: TorchClient
    model: int  # index into BatchedTrainer._models
    loss_key: object
    loader: PlainLoader  # its train_loader, read by indexing

    @property
    def base(self) -> TensorDataset:
        return self.loader.base

    @property
    def local(self) -> torch.Tensor | None:  # indices into ``base`` (a Subset), or None for all of it
        return self.loader.local

    @property
    def batch_size(self) -> int:
        return self.loader.batch_size


def loader_size(s: ClientStatic) -> int:
    """The examples of an epoch of the client's train loader (0: it has no data)."""
    return len(s.loader)


def loss_key_of(fn: Callable[..., Any]) -> object:
    """Clients whose losses share this key compute the same function."""
    if isinstance(fn, nn.Module):
        return (type(fn), repr(fn))
    code = getattr(fn, "__code__", None)
    if code is not None and getattr(fn, "__closure__", None) is None:
        return (code, getattr(fn, "__defaults__", None))
    return fn


def per_example_loss(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss_fn`` per example: ``[B, ...] -> [B]``, their mean being ``loss_fn`` of the batch."""
    ce = fn is nn.functional.cross_entropy or (
        type(fn) is nn.CrossEntropyLoss and fn.weight is None and fn.reduction == "mean"
    )
    if ce:
        smoothing = float(getattr(fn, "label_smoothing", 0.0))
        ignore = int(getattr(fn, "ignore_index", -100))

        def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            per = nn.functional.cross_entropy(
                out, y, reduction="none", ignore_index=ignore, label_smoothing=smoothing
            )
            return per.flatten(1).mean(1) if per.dim() > 1 else per

        return cross_entropy
    return vmap(lambda o, t: fn(o.unsqueeze(0), t.unsqueeze(0)))


def check_batchable_modules(model: nn.Module) -> None:
    """Raises ``NotBatchable`` (naming the module) for a layer that batched clients would change:
    batch norm, running statistics, dropout."""
    for name, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            if module.track_running_stats:
                raise NotBatchable(f"{kind} at '{name}' updates running statistics, which vmap cannot batch")
            raise NotBatchable(f"{kind} at '{name}' normalizes over the batch, which padding would change")
        if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
            raise NotBatchable(f"{kind} at '{name}' updates running statistics, which vmap cannot batch")
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            raise NotBatchable(
                f"{kind} at '{name}' draws random masks, which batched clients would not draw as each does alone (same seed, same stream)"
            )


def describe_model(model: nn.Module, device: torch.device) -> ModelLayout:
    """What the engine reads of ``model``: names, tied weights, trainable and frozen parameters,
    buffers, dtypes, shapes and its state's bytes."""
    raw = model.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    canonical: dict[str, str] = {}
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for key, t in raw.items():
        canonical[key] = first.setdefault(id(t), key)
    trainable = [n for n, p in params.items() if p.requires_grad]
    frozen = [n for n, p in params.items() if not p.requires_grad]
    persistent = [n for n in buffers if n in raw]
    dtypes = {n: t.dtype for n, t in [*params.items(), *buffers.items()]}
    state_bytes = sum(t.numel() * t.element_size() for t in [*params.values(), *buffers.values()])
    shapes = {k: tuple(t.shape) for k, t in raw.items()}
    return ModelLayout(
        model, device, list(raw), canonical, trainable, frozen, persistent, dtypes, shapes, state_bytes
    )
