"""A Hugging Face causal LM with LoRA adapters (``--model hf:PATH --peft lora:...``) whose state is the
adapters alone, so that only they travel, are aggregated, compressed and checkpointed.

:func:`build_peft_lm` loads the base from the local folder (its weights, or its ``config.json``
initialized under :data:`BASE_SEED` in every process, so every side builds the same base), wraps
it with ``peft.get_peft_model`` (``LoraConfig`` from the spec; A initialized under the same seed)
and freezes it. :class:`PeftLM`'s ``state_dict`` holds the adapter tensors only (with
``lora_aggregation = "ffa"``: the B factors only, A frozen) and ``load_state_dict`` takes
exactly those; every other tensor is the frozen base, whose :attr:`PeftLM.base_hash` a client
shows at Join. ``peft`` and ``transformers`` are imported only here and in
``fedgrid.simulation.language`` (the ``llm`` extra).
"""

from __future__ import annotations

import hashlib
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from fedgrid.config_llm import LoraSpec, parse_peft
from fedgrid.errors import ConfigError

__all__ = ["PeftLM", "BASE_SEED", "build_peft_lm", "tensor_hash", "export_run_model", "export_run"]

#: The seed a base built from ``config.json`` alone, and the adapters' first A, are drawn under.
BASE_SEED = 0


def tensor_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """``sha256:HEX`` of the names, dtypes, shapes and bytes of ``tensors`` in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + digest.hexdigest()


class PeftLM(nn.Module):
    """A PEFT-wrapped causal LM from token ids ``[N, T]`` to logits ``[N, T, V]`` whose state is its
    adapters (``adapter_names``; the wrapped model's names under ``net.``).

    Attributes:
        spec: the LoRA adapter.
        frozen_a: whether A is frozen and left out of the state (FFA-LoRA).
        adapter_names: the state's names, in the model's order.
        base_hash: :func:`tensor_hash` of every other tensor (the base, and a frozen A).
    """

    net: Any  # a peft.PeftModel (typed loosely: peft is optional)

    def __init__(self, net: nn.Module, spec: LoraSpec, *, frozen_a: bool = False) -> None:
        super().__init__()
        self.net = net
        self.spec = spec
        self.frozen_a = frozen_a
        names = []
        for name, p in self.named_parameters():
            trains = ".lora_B." in name or (".lora_A." in name and not frozen_a)
            p.requires_grad_(trains)
            if trains:
                names.append(name)
        if not names:
            raise ConfigError("peft", f"no layer of the model matches targets={','.join(spec.targets)}")
        self.adapter_names = tuple(names)
        full = super().state_dict()
        self.base_hash = tensor_hash({k: v for k, v in full.items() if k not in set(names)})

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=idx, use_cache=False).logits

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """The adapter tensors (``adapter_names``) of the module's state (same arguments)."""
        destination = kwargs.pop("destination", None)
        full = super().state_dict(*args, **kwargs)
        keep = {kwargs.get("prefix", "") + n for n in self.adapter_names}
        out = OrderedDict((k, v) for k, v in full.items() if k in keep)
        if destination is not None:
            destination.update(out)
            return destination
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Loads adapter tensors; with ``strict``, exactly ``adapter_names``.

        Raises:
            RuntimeError: (strict) a missing or unexpected name, named.
        """
        missing = [n for n in self.adapter_names if n not in state_dict]
        unexpected = [n for n in state_dict if n not in set(self.adapter_names)]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"adapter state does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
                + (" (a full model's state: is --peft set on both sides?)" if len(unexpected) > 3 else "")
            )
        wanted = {k: v for k, v in state_dict.items() if k in set(self.adapter_names)}
        return super().load_state_dict(wanted, strict=False, assign=assign)

    def base_model_with_adapters_merged(self) -> Any:
        """A copy of the Hugging Face model with the adapters merged into its weights (``merge_and_unload``)."""
        import copy

        return copy.deepcopy(self.net).merge_and_unload()


def build_peft_lm(path: str, peft: str, *, frozen_a: bool = False, vocab: int = 0) -> PeftLM:
    """The base model of the local folder ``path`` with the adapters ``peft`` names, under
    :data:`BASE_SEED` (torch's global RNG is left as it was; the caller holds
    ``fedgrid.seeding.RNG_LOCK``, as ``build_model``'s callers do).

    Raises:
        ConfigError: ``peft`` or ``transformers`` not installed, a bad spec, or targets that
            match no layer (names ``peft``).
    """
    from fedgrid.simulation.language import build_lm, lm_spec

    spec = parse_peft(peft)
    if spec is None:
        raise ConfigError("peft", "no adapter given (expected lora or lora:r=...,alpha=...,targets=...)")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("peft", "adapters need the peft package: pip install 'fedgrid[llm]'") from None
    lm = lm_spec(f"hf:{path}")
    assert lm is not None
    # Every caller of build_model holds RNG_LOCK already (a plain Lock: taking it here would deadlock).
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft calls transformers' renamed helpers
        torch.manual_seed(BASE_SEED)
        base = (build_lm(lm, vocab) if vocab else build_lm(lm)).net
        config = LoraConfig(
            r=spec.r,
            lora_alpha=spec.alpha,  # type: ignore[arg-type]  # a float works: the scale is alpha / r
            target_modules=list(spec.targets),
            lora_dropout=spec.dropout,
        )
        try:
            net = get_peft_model(base, config)  # type: ignore[arg-type]  # build_lm's net is a Module
        except ValueError as exc:
            raise ConfigError("peft", f"{peft!r} on hf:{path}: {exc}") from None
    return PeftLM(net, spec, frozen_a=frozen_a)


def export_run_model(
    model: PeftLM, state: Mapping[str, torch.Tensor], out: str | Path, *, merged: bool
) -> Path:
    """Writes ``model`` with the adapter ``state`` to the folder ``out``: the base with the
    adapters merged (``save_pretrained`` of ``merge_and_unload``; loads with
    ``AutoModelForCausalLM.from_pretrained``), or the adapter alone in PEFT's format
    (``adapter_config.json`` and ``adapter_model.safetensors``; loads with
    ``PeftModel.from_pretrained(base, out)``). Returns ``out``."""
    model.load_state_dict(state)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    if merged:
        model.base_model_with_adapters_merged().save_pretrained(folder)
    else:
        model.net.save_pretrained(folder)
    return folder


def export_run(run_dir: str | Path, out: str | Path, *, merged: bool) -> Path:
    """``fedgrid export``: the ``--peft`` run in ``run_dir`` (its ``config.toml`` and final
    ``model.safetensors``) written by :func:`export_run_model`. Returns ``out``.

    Raises:
        ConfigError: no run there, a run without adapters, or a model folder gone (names the key).
    """
    from fedgrid.config import load_config
    from fedgrid.runlog import load_model
    from fedgrid.simulation.language import lm_spec

    folder = Path(run_dir)
    files = [folder / "config.toml", folder / "model.safetensors"]
    for file in files:
        if not file.is_file():
            raise ConfigError("run_dir", f"{folder} holds no {file.name}: not a finished run directory")
    config = load_config(files[0])
    spec = lm_spec(config.model)
    if not config.peft or spec is None or spec.kind != "hf":
        raise ConfigError(
            "peft", f"{folder} is not a --peft run (model {config.model!r}, peft {config.peft!r})"
        )
    model = build_peft_lm(spec.path, config.peft, frozen_a=config.lora_aggregation == "ffa")
    return export_run_model(model, load_model(files[1]), out, merged=merged)
