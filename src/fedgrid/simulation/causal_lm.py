"""Causal-LM training options of the built-in client (``grad_accum``, ``grad_checkpointing``) and a
tokenized-text dataset for language-model clients: a local text file through the model folder's
tokenizer, or a byte-level fallback (token = byte, 256 of them) when the folder has none.

``AccumulatingClient`` is a ``TorchClient`` whose optimizer step follows ``grad_accum``
micro-batches: each batch of the loader is split into that many, each one's loss (scaled by its
share of the batch) is back-propagated as it is computed, so the step sees the gradient of the
whole batch while the activations held are a micro-batch's. A multi-process client
(``--nproc-per-node``) splits each batch over its ranks instead (``fedgrid.client.parallel``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from fedgrid.client.precision import autocast
from fedgrid.client.torch_client import TorchClient
from fedgrid.errors import ConfigError

__all__ = [
    "load_text_windows",
    "text_vocab",
    "TEXT_TRAIN_SHARE",
    "AccumulatingClient",
    "ByteTokenizer",
    "load_tokenizer",
    "text_tokens",
    "TokenWindows",
    "enable_checkpointing",
]


class AccumulatingClient(TorchClient):
    """A ``TorchClient`` that accumulates the gradients of ``grad_accum`` micro-batches per step."""

    grad_accum: int = 1

    def _batch_loss(
        self, module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        parts = min(self.grad_accum, len(targets))
        if parts <= 1:
            return super()._batch_loss(module, inputs, targets)
        total, example_sum = len(targets), 0.0
        chunks = list(zip(torch.tensor_split(inputs, parts), torch.tensor_split(targets, parts)))
        for i, (x, y) in enumerate(chunks):
            with autocast(self.device, self.precision):
                loss = self.loss_fn(module(x), y) * (len(y) / total)
            example_sum += float(loss.detach()) * total
            if i < len(chunks) - 1:
                loss.backward()  # the last one's backward is the caller's
        return loss, example_sum


def enable_checkpointing(model: nn.Module) -> None:
    """Gradient (activation) checkpointing on the Hugging Face model inside ``model`` (non-reentrant,
    so frozen inputs of an adapter model need no gradient).

    Raises:
        ConfigError: a model without Hugging Face's ``gradient_checkpointing_enable`` (names ``grad_checkpointing``).
    """
    net = getattr(model, "net", model)
    hf = getattr(getattr(net, "base_model", None), "model", net)  # a PeftModel's wrapped model
    enable = getattr(hf, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ConfigError(
            "grad_checkpointing", "applies to --model hf:PATH models (Hugging Face's checkpointing)"
        )
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class ByteTokenizer:
    """The byte-level fallback: UTF-8 bytes as tokens 0..255 (the model's vocabulary must hold 256)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def load_tokenizer(model_path: str, spec: str = "") -> Any:
    """The tokenizer ``spec`` names: ``bytes`` (:class:`ByteTokenizer`), a local folder, or ``""``:
    the model folder's own when it holds one (``tokenizer.json`` or ``tokenizer_config.json``),
    else bytes. Nothing is downloaded.

    Raises:
        ConfigError: a folder given that holds no tokenizer (names ``tokenizer``).
    """
    if spec == "bytes":
        return ByteTokenizer()
    folder = Path(spec or model_path)
    has = any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    if not has:
        if spec:
            raise ConfigError(
                "tokenizer", f"{spec}: no tokenizer.json or tokenizer_config.json in the folder"
            )
        return ByteTokenizer()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def text_tokens(path: str, tokenizer: Any) -> torch.Tensor:
    """The token ids of the local text file ``path`` (int64).

    Raises:
        ConfigError: no such file (names ``text_file``).
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError("text_file", f"{path}: no such file")
    return torch.tensor(tokenizer.encode(file.read_text(encoding="utf-8")), dtype=torch.int64)


class TokenWindows(Dataset):
    """Non-overlapping windows of ``context`` tokens of ``tokens`` with their next-token targets
    (each token the target of one window at most), optionally only windows ``start..stop``."""

    def __init__(self, tokens: torch.Tensor, context: int, start: int = 0, stop: int | None = None) -> None:
        if context < 1:
            raise ValueError(f"context must be at least 1, got {context}")
        self.tokens, self.context = tokens, context
        count = max((len(tokens) - 1) // context, 0)
        self.start, self.stop = start, count if stop is None else min(stop, count)

    def __len__(self) -> int:
        return max(self.stop - self.start, 0)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        at = (self.start + i) * self.context
        return self.tokens[at : at + self.context], self.tokens[at + 1 : at + 1 + self.context]


#: Share of each text file's windows that train (the rest are its test windows), as Shakespeare's roles.
TEXT_TRAIN_SHARE = 0.9


def load_text_windows(data_dir: str, context: int) -> Any:
    """``--dataset text``: every ``*.txt`` file of ``data_dir`` (a group each, in name order: the
    ``natural`` partition gives each client whole files) tokenized by the folder's own tokenizer
    (``tokenizer.json`` or ``tokenizer_config.json`` there) or bytes, cut into non-overlapping
    windows of ``context`` tokens; each file's first 90% of windows train, the rest test. A
    ``CharData`` over the tokens, so the language-model path reads it as Shakespeare's characters.

    Raises:
        ConfigError: no ``*.txt`` file, or none with two windows (names ``data_dir``).
    """
    import numpy as np

    from fedgrid.simulation.shakespeare import CharData

    files = sorted(Path(data_dir).glob("*.txt"))
    if not files:
        raise ConfigError("data_dir", f"{data_dir}: no *.txt file (dataset text reads every one)")
    tokenizer = load_tokenizer(data_dir)
    texts, train, test, train_groups, test_groups, offset = [], [], [], [], [], 0
    for group, file in enumerate(files):
        ids = text_tokens(str(file), tokenizer)
        count = max((len(ids) - 1) // context, 0)
        cut = min(max(int(count * TEXT_TRAIN_SHARE), 1), count - 1) if count >= 2 else count
        starts = offset + context * np.arange(count)
        train.append(starts[:cut])
        test.append(starts[cut:])
        train_groups.append(np.full(cut, group))
        test_groups.append(np.full(count - cut, group))
        texts.append(ids)
        offset += len(ids)
    if not sum(len(t) for t in test):
        raise ConfigError("data_dir", f"{data_dir}: the text files hold no two windows of {context} tokens")
    size = int(getattr(tokenizer, "vocab_size", 256))
    data = CharData(
        text=torch.cat(texts),
        train_starts=torch.from_numpy(np.concatenate(train)).long(),
        test_starts=torch.from_numpy(np.concatenate(test)).long(),
        train_roles=np.concatenate(train_groups).astype(np.int64),
        test_roles=np.concatenate(test_groups).astype(np.int64),
        roles=[f.name for f in files],
        vocab="\0" * max(size, len(getattr(tokenizer, "get_vocab", lambda: {})())),
        seq_len=context,
    )
    return data


def text_vocab(data_dir: str) -> int:
    """Tokens of ``--dataset text``'s tokenizer in ``data_dir`` (256: bytes)."""
    tokenizer = load_tokenizer(data_dir)
    return max(int(getattr(tokenizer, "vocab_size", 256)), len(getattr(tokenizer, "get_vocab", lambda: {})()))
