"""Small clients shared by integration tests."""

from __future__ import annotations

from collections import OrderedDict

from fedgrid.client import Client, FitOutput


class Named(Client):
    """Returns the global model plus one under a given name."""

    def __init__(self, name: str, num_examples: int = 3) -> None:
        self.name = name
        self._n = num_examples

    @property
    def num_examples(self) -> int:
        return self._n

    def fit(self, state, ins):
        return FitOutput(OrderedDict((k, v + 1) for k, v in state.items()), num_examples=self._n)
