"""Built-in models, by name: the small networks of the federated-learning literature.

``digits_mlp`` is the zero-setup default; ``fmnist_mlp`` and ``fmnist_cnn`` are the 2NN and
CNN of McMahan et al. 2017 ("Communication-Efficient Learning of Deep Networks from
Decentralized Data"); ``char_lstm`` is LEAF's Shakespeare next-character model;
``logistic`` is multinomial logistic regression (the model of the synthetic data).

Inputs: digits as ``[N, 64]`` floats, Fashion-MNIST as ``[N, 1, 28, 28]`` floats in [0, 1],
Shakespeare as ``[N, T]`` int64 character indices. Every model returns class scores
``[N, classes]``. None keeps running statistics (no BatchNorm), so all of them can be
batched with ``torch.func``.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["digits_mlp", "fmnist_mlp", "fmnist_cnn", "char_lstm", "logistic", "CharLSTM"]


def digits_mlp() -> nn.Module:
    """A small MLP for 8x8 digits (64 -> 64 -> 10): 4,810 parameters."""
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def fmnist_mlp(num_classes: int = 10) -> nn.Module:
    """McMahan et al. 2017's 2NN: 784 -> 200 -> 200 -> classes with ReLU (199,210 parameters)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 200),
        nn.ReLU(),
        nn.Linear(200, 200),
        nn.ReLU(),
        nn.Linear(200, num_classes),
    )


def fmnist_cnn(num_classes: int = 10) -> nn.Module:
    """McMahan et al. 2017's CNN for 28x28 images: two 5x5 convolutions (32 and 64 channels),
    each followed by ReLU and 2x2 max pooling, then fc 512 and the classes (1,663,370
    parameters with 10 classes)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(3136, 512),
        nn.ReLU(),
        nn.Linear(512, num_classes),
    )


class CharLSTM(nn.Module):
    """LEAF's Shakespeare model: embedding (8), a 2-layer LSTM (256), a linear layer to the
    vocabulary on the last position's output."""

    def __init__(self, vocab_size: int, *, embed_dim: int = 8, hidden: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x))
        return self.head(out[:, -1])


def char_lstm(vocab: int | str) -> nn.Module:
    """``CharLSTM`` over ``vocab`` (its size, or the vocabulary string itself)."""
    size = len(vocab) if isinstance(vocab, str) else int(vocab)
    if size < 1:
        raise ValueError(f"vocabulary size must be at least 1, got {size}")
    return CharLSTM(size)


def logistic(in_features: int, classes: int) -> nn.Module:
    """Multinomial logistic regression: flatten, then one linear layer to the class scores."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, classes))
