"""A user app for fault tests: predictable updates and controllable compute time.

Client i returns ``global + (i + 1)`` with ``num_examples = i + 1``, so the exact weighted
mean of any set of arrivals is known. Before computing it writes ``MARKER_DIR/fit-i-r``
(so a test knows it is mid-round) and then "computes" for ``SLOW_APP_FIT_S`` seconds, or
``SLOW_APP_SLOW_S`` for the client listed in ``SLOW_APP_SLOW_CLIENT``.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

from torch import nn

from fedgrid.client import Client, FitOutput


def model() -> nn.Module:
    return nn.Linear(4, 2)


class SlowClient(Client):
    def __init__(self, index: int, total: int) -> None:
        self.index = index
        self.name = f"slow-{index:03d}/{total}"

    @property
    def num_examples(self) -> int:
        return self.index + 1

    def fit(self, state, ins):
        Path(os.environ["SLOW_APP_MARKER_DIR"], f"fit-{self.index}-{ins.round}").touch()
        slow = str(self.index) == os.environ.get("SLOW_APP_SLOW_CLIENT", "")
        compute_s = float(os.environ["SLOW_APP_SLOW_S" if slow else "SLOW_APP_FIT_S"])
        threading.Event().wait(compute_s)  # stands in for training time
        update = OrderedDict((k, v + (self.index + 1)) for k, v in state.items())
        return FitOutput(update, num_examples=self.index + 1, metrics={"loss": float(self.index)})


def client(partition: int, num_partitions: int, seed: int) -> SlowClient:
    return SlowClient(partition, num_partitions)
