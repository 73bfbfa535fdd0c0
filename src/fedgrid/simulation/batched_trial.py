"""What the batched engine checks before it trains, and what it measures meanwhile.

``inspect_clients`` checks each client (a plain ``TorchClient``, a plain loader, an optimizer
the engine knows) and each distinct model (its modules); ``trial`` runs one batched step of
two copies of a model on a client's first batch and compares it with the model alone, which
rejects what vmap cannot batch (data-dependent control flow, ops without a batching rule)
and a loss that is not a mean over examples. The model alone's step also measures what chunks
are sized by: the bytes of one client's activations, its largest tensor and the share of
FLOPs in convolutions. Part of the batched engine (``fedgrid.simulation.batched``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from fedgrid.client.api import Client
from fedgrid.client.loaders import NotPlainLoader, plain_loader
from fedgrid.client.precision import autocast_dtype
from fedgrid.client.torch_client import TorchClient
from fedgrid.simulation.batched_models import (
    TORCH_CLIENT_METHODS,
    ClientStatic,
    ModelLayout,
    check_batchable_modules,
    describe_model,
    loader_size,
    loss_key_of,
    per_example_loss,
)
from fedgrid.simulation.batched_optim import NotBatchable, optimizer_spec

__all__ = ["inspect_clients", "trial"]

#: ``BatchedTrainer._step_fn``: ``(model, loss_fn, loss_key, mu) -> step``.
StepFn = Callable[[ModelLayout, Callable[..., Any], object, float], Callable[..., Any]]


def inspect_clients(
    clients: Sequence[Client], models: list[ModelLayout], statics: dict[int, ClientStatic]
) -> None:
    """Checks every client, filling ``models`` (one per distinct model) and ``statics`` (one per
    client, by index) as it goes.

    Raises:
        NotBatchable: the first client that cannot train batched, and why.
    """
    signatures: dict[tuple[Any, ...], int] = {}
    if not clients:
        raise NotBatchable("the fleet has no clients")
    for i, client in enumerate(clients):
        label = f"client {client.name or i!r}"
        if not isinstance(client, TorchClient):
            raise NotBatchable(f"{label} is a {type(client).__name__}, not a TorchClient")
        overridden = [
            m for m in TORCH_CLIENT_METHODS if getattr(type(client), m) is not getattr(TorchClient, m)
        ]
        if overridden:
            raise NotBatchable(f"{label} overrides TorchClient.{overridden[0]}")
        if autocast_dtype(client.device, client.precision) is not None:
            raise NotBatchable(
                f"{label} runs its forward passes in bf16 autocast (precision {client.precision}), "
                "which this engine does not: precision fp32 batches it"
            )
        try:
            loader = plain_loader(client.train_loader)
            optimizer_spec(client.optimizer_factory(list(client.model.parameters())))
        except (NotBatchable, NotPlainLoader) as exc:
            raise NotBatchable(f"{label}: {exc}") from None
        model = client.model
        sig = (
            type(model),
            repr(model),
            client.device,
            tuple((k, t.dtype, tuple(t.shape)) for k, t in model.state_dict().items()),
        )
        if sig not in signatures:
            try:
                check_batchable_modules(model)
            except NotBatchable as exc:
                raise NotBatchable(f"{label}: {exc}") from None
            signatures[sig] = len(models)
            models.append(describe_model(model, client.device))
        statics[i] = ClientStatic(i, client, signatures[sig], loss_key_of(client.loss_fn), loader)


def trial(m: ModelLayout, s: ClientStatic, step_fn: StepFn) -> None:
    """One batched step of two copies of ``s``'s model on its first batch; measures FLOPs and
    activations into ``m``.

    Raises:
        NotBatchable: the batched step's loss is not the model's alone, or ``_measure``'s reasons.
    """
    n = loader_size(s)
    if n == 0:
        return
    rows = (s.local if s.local is not None else torch.arange(n))[: s.batch_size]
    x, y = (t[rows].to(m.device) for t in s.base.tensors)
    batch_loss = _measure(m, s, x, y)
    template = m.template
    stacked = {n: torch.stack([p.detach()] * 2) for n, p in template.named_parameters() if p.requires_grad}
    frozen = {
        n: torch.stack([t.detach()] * 2)
        for n, t in [*template.named_parameters(), *template.named_buffers()]
        if n not in stacked
    }
    fn = step_fn(m, s.client.loss_fn, s.loss_key, 0.0)
    mask = torch.ones(2, len(rows), dtype=torch.bool, device=m.device)
    count = torch.full((2,), float(len(rows)), device=m.device)
    grads, (_, loss) = fn(stacked, frozen, None, torch.stack([x, x]), torch.stack([y, y]), mask, count)
    if not math.isclose(float(loss[0]), batch_loss, rel_tol=1e-4, abs_tol=1e-5):
        raise NotBatchable(
            f"a trial batched step gave loss {float(loss[0]):.6g}, the model alone {batch_loss:.6g}"
        )


def _measure(m: ModelLayout, s: ClientStatic, x: torch.Tensor, y: torch.Tensor) -> float:
    """The model alone's step on ``(x, y)``: its batch loss; ``m``'s activation and largest
    tensor bytes and its share of FLOPs in convolutions.

    Raises:
        NotBatchable: a parameter that gets no gradient, or a loss that is not a mean over examples.
    """
    from torch.utils.flop_counter import FlopCounterMode

    per_example = per_example_loss(s.client.loss_fn)
    template = m.template
    template.train()
    leaves = [mod for mod in template.modules() if not list(mod.children())]
    sizes: list[int] = []
    hooks = [
        mod.register_forward_hook(
            lambda _m, _i, o: sizes.append(o.numel() * o.element_size() if isinstance(o, torch.Tensor) else 0)
        )
        for mod in leaves
    ]
    try:
        with (
            torch.random.fork_rng(devices=[m.device] if m.device.type == "cuda" else []),
            FlopCounterMode(display=False) as counter,
        ):
            out = template(x)
            full = s.client.loss_fn(out, y)
            per = per_example(out, y)
            full.backward()
        unused = [n for n, p in template.named_parameters() if p.requires_grad and p.grad is None]
    finally:
        for h in hooks:
            h.remove()
        template.zero_grad(set_to_none=True)
    if unused:  # torch.optim skips them; torch.func.grad would give zeros that weight decay and Adam act on
        raise NotBatchable(f"parameter '{unused[0]}' gets no gradient")
    batch_loss, mean_loss = float(full.detach()), float(per.detach().mean())
    if not math.isclose(mean_loss, batch_loss, rel_tol=1e-5, abs_tol=1e-6):
        raise NotBatchable(
            f"its loss_fn is not a mean over examples ({batch_loss:.6g} on a batch, {mean_loss:.6g} averaged per example)"
        )
    m.activation_bytes = sum(sizes) + x.numel() * x.element_size()
    m.largest_bytes = max(
        [*sizes, x.numel() * x.element_size(), *(p.numel() * p.element_size() for p in template.parameters())]
    )
    counts = counter.get_flop_counts().get("Global", {})
    total = sum(counts.values())
    conv = sum(v for op, v in counts.items() if "convolution" in str(op))
    m.conv_share = conv / total if total else 0.0
    return batch_loss
