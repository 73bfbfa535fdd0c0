"""Language models on Shakespeare's characters: a nanoGPT-like decoder (``--model gpt``), any
Hugging Face ``transformers`` causal LM (``--model hf:PATH``), their examples and their loss.

Model specs (the ``model`` key with ``dataset = "shakespeare"``):

- ``gpt`` or ``gpt:layers=L,heads=H,dim=D,context=T,tie=0|1``: :class:`GPT`, any subset of
  the sizes (the others keep :data:`GPT_DEFAULT`: 2 layers, 4 heads, width 64, 64
  characters of context, untied head; 114,432 parameters, so that a round of 10 DiLoCo
  workers at H = 50 takes about 25 s on 2 CPU cores).
- ``hf:PATH``: :class:`HFCausalLM` over ``AutoModelForCausalLM`` built from the local folder
  ``PATH``: from its weights when it holds them (``from_pretrained``), else from its
  ``config.json`` alone (``from_config``, a fresh initialization under the run's seed).
  Nothing is downloaded (``local_files_only``). Its vocabulary must cover the 80 characters;
  its context is :data:`HF_CONTEXT` characters, or fewer when its positions are fewer.
  ``transformers`` is imported only here, when such a model is built (the ``hf`` extra).

Examples: the training (and test) characters of every role cut into non-overlapping windows
of ``context`` characters (:func:`lm_windows`); an example's targets are its window shifted
by one character (:func:`next_char_windows`), and the loss is the mean cross-entropy over
every position (:func:`token_cross_entropy`, nats per token). Every window holds exactly
``context`` targets and every training character is the target of one window at most, so a
client's ``num_examples`` (windows) times ``context`` is the tokens it trained on, and
weights by examples are weights by tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedgrid.errors import ConfigError
from fedgrid.simulation.shakespeare import VOCAB, CharData, Split

__all__ = [
    "GPT",
    "GPTSize",
    "GPT_DEFAULT",
    "HF_CONTEXT",
    "HFCausalLM",
    "LMSpec",
    "lm_spec",
    "check_lm",
    "build_lm",
    "token_cross_entropy",
    "lm_windows",
    "next_char_windows",
]

#: The ``gpt`` sizes a spec does not set.
GPT_SIZE_KEYS = ("layers", "heads", "dim", "context", "tie")
#: Characters of context of an ``hf:`` model (fewer when its position table is smaller).
HF_CONTEXT = 64
#: Files that hold a Hugging Face model's weights (then ``hf:PATH`` loads them).
_HF_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
#: ``config.json`` keys that give a model's number of positions, by model family.
_HF_POSITIONS = ("n_positions", "max_position_embeddings", "n_ctx", "seq_length")


@dataclass(frozen=True)
class GPTSize:
    """A :class:`GPT`'s sizes: ``layers`` blocks of ``heads`` attention heads over a width of
    ``dim`` (a multiple of ``heads``), ``context`` positions, and whether the output head
    shares the token embedding's weights (``tie``)."""

    layers: int = 2
    heads: int = 4
    dim: int = 64
    context: int = 64
    tie: bool = False


#: ``--model gpt``'s sizes. Untied by default: a tied head is one tensor under two state keys,
#: sent twice and, with streaming DiLoCo's fragments, possibly synced in different rounds.
GPT_DEFAULT = GPTSize()


def parse_gpt(spec: str) -> GPTSize:
    """Parses ``gpt`` or ``gpt:KEY=VALUE,...`` (keys: ``GPT_SIZE_KEYS``).

    Raises:
        ConfigError: an unknown key, a value that is not a whole number, a size below 1, or
            ``heads`` not dividing ``dim`` (names ``model``).
    """
    name, _, body = spec.partition(":")
    if name != "gpt":
        raise ConfigError("model", f"expected gpt or gpt:KEY=VALUE,..., got {spec!r}")
    sizes: dict[str, int] = {}
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in GPT_SIZE_KEYS:
            raise ConfigError(
                "model",
                f"{spec!r}: expected KEY=VALUE with KEY one of {', '.join(GPT_SIZE_KEYS)}, got {item!r}",
            )
        try:
            sizes[key] = int(value)
        except ValueError:
            raise ConfigError(
                "model", f"{spec!r}: {key} must be a whole number, got {value.strip()!r}"
            ) from None
    tie = sizes.pop("tie", int(GPT_DEFAULT.tie))
    if tie not in (0, 1):
        raise ConfigError("model", f"{spec!r}: tie must be 0 or 1, got {tie}")
    size = dataclasses.replace(GPT_DEFAULT, tie=bool(tie), **sizes)
    for key in ("layers", "heads", "dim", "context"):
        if getattr(size, key) < 1:
            raise ConfigError("model", f"{spec!r}: {key} must be at least 1, got {getattr(size, key)}")
    if size.dim % size.heads:
        raise ConfigError(
            "model", f"{spec!r}: heads ({size.heads}) must divide dim ({size.dim}): each head takes dim/heads"
        )
    return size


class _Attention(nn.Module):
    """Causal multi-head self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = (z.view(n, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(n, t, d))


class _Block(nn.Module):
    """A pre-norm block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))`` (MLP 4x wide, GELU)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A decoder-only transformer (nanoGPT's): token and position embeddings, pre-norm causal
    blocks, a final LayerNorm and a linear head to the vocabulary. No dropout.

    Weights start as nanoGPT's: normal(0, 0.02), biases zero, each residual output
    projection at ``0.02 / sqrt(2 * layers)``.

    Args:
        vocab: tokens (the character vocabulary's size).
        size: the sizes (:class:`GPTSize`).
    """

    def __init__(self, vocab: int, size: GPTSize = GPT_DEFAULT) -> None:
        super().__init__()
        self.size = size
        self.tok = nn.Embedding(vocab, size.dim)
        self.pos = nn.Embedding(size.context, size.dim)
        blocks = [_Block(size.dim, size.heads) for _ in range(size.layers)]
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(size.dim)
        self.head = nn.Linear(size.dim, vocab, bias=False)
        if size.tie:
            self.head.weight = self.tok.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in blocks:
            for proj in (block.attn.proj, block.out):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * size.layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, T, vocab]`` of the next token at every position of ``idx`` ``[N, T]``.

        Raises:
            ValueError: ``T`` is longer than the context.
        """
        t = idx.shape[1]
        if t > self.size.context:
            raise ValueError(f"{t} tokens do not fit a context of {self.size.context}")
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM as a module from token ids ``[N, T]`` to logits ``[N, T, V]``
    (its state keys are the wrapped model's under ``net.``)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=idx, use_cache=False).logits


@dataclass(frozen=True)
class LMSpec:
    """A language model named by the ``model`` key: ``gpt`` with its sizes, or ``hf`` with its folder."""

    kind: Literal["gpt", "hf"]
    gpt: GPTSize | None = None
    path: str = ""

    @property
    def context(self) -> int:
        """Characters per example window (``hf``: :data:`HF_CONTEXT`, or fewer when its
        ``config.json`` gives fewer positions).

        Raises:
            ConfigError: an ``hf`` folder without a readable ``config.json`` (names ``model``).
        """
        if self.gpt is not None:
            return self.gpt.context
        config = _hf_config(self.path)
        positions = [config[k] for k in _HF_POSITIONS if isinstance(config.get(k), int) and config[k] > 0]
        return min([HF_CONTEXT, *positions])


def lm_spec(model: str) -> LMSpec | None:
    """The language model ``model`` names (``gpt``, ``gpt:...``, ``hf:PATH``), or ``None``
    for any other model name.

    Raises:
        ConfigError: a bad ``gpt`` size string, or ``hf:`` without a path (names ``model``).
    """
    name, _, rest = model.partition(":")
    if name == "gpt":
        return LMSpec("gpt", gpt=parse_gpt(model))
    if name == "hf":
        if not rest:
            raise ConfigError("model", "hf: needs the folder of a Hugging Face model: hf:PATH")
        return LMSpec("hf", path=rest)
    return None


def _hf_config(path: str) -> dict[str, Any]:
    """``PATH/config.json`` as a dict.

    Raises:
        ConfigError: no such folder, no ``config.json`` in it, or not JSON (names ``model``).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError("model", f"hf:{path}: no such folder (expected a local Hugging Face model folder)")
    file = folder / "config.json"
    if not file.is_file():
        raise ConfigError(
            "model",
            f"hf:{path}: no config.json in the folder: save one with the model config's save_pretrained(PATH)",
        )
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("model", f"hf:{path}: config.json is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError("model", f"hf:{path}: config.json must hold a JSON object")
    return config


def _check_vocab(path: str, vocab_size: object, vocab: int) -> None:
    if isinstance(vocab_size, int) and vocab_size < vocab:
        raise ConfigError(
            "model",
            f"hf:{path}: vocabulary of {vocab_size} tokens is too small: the characters need {vocab} "
            f"(set vocab_size >= {vocab} in its config.json)",
        )


def check_lm(spec: LMSpec, vocab: int = len(VOCAB)) -> None:
    """Checks what can be checked before building: an ``hf`` folder's ``config.json`` and its
    vocabulary size against ``vocab`` (``transformers`` is not imported).

    Raises:
        ConfigError: a missing folder or ``config.json``, or a vocabulary smaller than ``vocab``
            (names ``model``).
    """
    if spec.kind == "hf":
        _check_vocab(spec.path, _hf_config(spec.path).get("vocab_size"), vocab)


def build_lm(spec: LMSpec, vocab: int = len(VOCAB)) -> nn.Module:
    """A fresh model for ``spec`` over ``vocab`` tokens (``hf``: its weights when the folder
    holds them, else initialized under torch's current seed).

    Raises:
        ConfigError: what :func:`check_lm` raises, ``transformers`` not installed, or a model
            whose vocabulary (once built) is too small (names ``model``).
    """
    if spec.gpt is not None:
        return GPT(vocab, spec.gpt)
    check_lm(spec, vocab)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder only: never reach the Hub
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ConfigError(
            "model", "hf: models need the transformers package: pip install 'fedgrid[hf]'"
        ) from None
    folder = Path(spec.path)
    if any((folder / name).is_file() for name in _HF_WEIGHTS):
        net = AutoModelForCausalLM.from_pretrained(spec.path, local_files_only=True)
    else:
        net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec.path, local_files_only=True))
    embeddings = net.get_output_embeddings()
    _check_vocab(spec.path, getattr(embeddings, "out_features", None), vocab)
    return HFCausalLM(net)


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits`` ``[N, T, V]`` against ``targets`` ``[N, T]`` over every
    position (``mean``: nats per token; ``sum``: over all tokens)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction=reduction
    )


def lm_windows(data: CharData) -> CharData:
    """``data`` with its windows cut to non-overlapping ones: in each role, the training
    windows starting every ``seq_len`` characters from the role's first, and the test
    windows the same from the role's first test window. ``data`` must have been loaded
    with ``seq_len`` = the context, so every kept window's shifted targets stay in its role."""

    def keep(starts: torch.Tensor, roles: np.ndarray) -> np.ndarray:
        if len(roles) == 0:
            return np.zeros(0, dtype=np.int64)
        first = np.flatnonzero(np.r_[True, roles[1:] != roles[:-1]])  # each role's first window
        base = np.repeat(starts.numpy()[first], np.diff(np.r_[first, len(roles)]))
        return np.flatnonzero((starts.numpy() - base) % data.seq_len == 0)

    train = keep(data.train_starts, data.train_roles)
    test = keep(data.test_starts, data.test_roles)
    return dataclasses.replace(
        data,
        train_starts=data.train_starts[torch.from_numpy(train)],
        test_starts=data.test_starts[torch.from_numpy(test)],
        train_roles=data.train_roles[train],
        test_roles=data.test_roles[test],
    )


def next_char_windows(
    data: CharData, split: Split, index: torch.Tensor | np.ndarray | slice
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ``[n, seq_len]`` (int64) of the chosen windows of ``split``: the
    targets are the inputs shifted by one character."""
    starts = data.train_starts if split == "train" else data.test_starts
    starts = starts[index if isinstance(index, slice) else torch.as_tensor(index, dtype=torch.int64)]
    view = data.text.unfold(0, data.seq_len, 1)
    return view[starts], view[starts + 1]
