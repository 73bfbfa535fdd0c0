"""SCAFFOLD (Karimireddy et al. 2020), server side: it corrects client drift on the client, and
the server's part is small (FedProx, the other drift correction, is ``fedgrid.aggregation.fedprox``).

The server keeps a control variate ``c`` (one tensor per real floating model
tensor, zero at first) and sends it with the model (``downlink_state``: the model plus
``scaffold.c.<name>`` tensors). Client ``i`` keeps its own ``c_i`` across rounds, corrects
each local step by ``c - c_i``, and sends back its model and ``c_delta_i = c_i+ - c_i`` as
``scaffold.c_delta.<name>`` tensors (declared in ``FitIns.expected``). The server sets::

    x <- x + server_lr * aggregate(y_i - x)        (a FedOpt step with ServerSGD)
    c <- c + (|S| / N) * mean(c_delta_i)

with ``S`` the clients that delivered and ``N`` all clients (``total_clients``, default
the number of live clients the round was configured with). The model aggregate is the
example-weighted mean by default, as in FedAvg (the paper's plain mean is
``aggregator=Mean(weighted=False)``). The ``c`` mean is unweighted, as in the paper, which
keeps ``c`` the average of all clients' ``c_i``; with a robust ``aggregator`` the same rule
is applied to the ``c_delta`` too (each counting once).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, Sequence

import torch

from fedgrid.aggregation.base import AggregationPreconditionError, Aggregator, held
from fedgrid.aggregation.fedavg import train_metrics
from fedgrid.aggregation.fedopt import FedOpt
from fedgrid.aggregation.mean import Mean
from fedgrid.aggregation.selection import Sampling
from fedgrid.aggregation.server_opt import ServerSGD
from fedgrid.aggregation.updates import compute_dtype, split_names
from fedgrid.types import ClientInfo, Failure, FitIns, FitRes, ModelState, TensorSpec

__all__ = ["Scaffold", "CONTROL_PREFIX", "CONTROL_DELTA_PREFIX"]

#: Downlink tensor ``CONTROL_PREFIX + name`` is the server control variate of model tensor ``name``.
CONTROL_PREFIX = "scaffold.c."
#: Uplink tensor ``CONTROL_DELTA_PREFIX + name`` is a client's control-variate change for ``name``.
CONTROL_DELTA_PREFIX = "scaffold.c_delta."


class Scaffold(FedOpt):
    """SCAFFOLD's server: model step with a server learning rate, control variate update.

    Task config: ``algorithm = "scaffold"``. Expected upload: the model plus one
    ``scaffold.c_delta.<name>`` tensor per real floating model tensor (the client sends
    zeros for tensors it does not train, e.g. BatchNorm running statistics).

    Args:
        server_lr: the global step size ``eta_g`` (1.0 in the paper's experiments).
        total_clients: N; ``None`` uses the number of live clients of the round.
        aggregator, sampling: as ``FedAvg`` (which clients a round asks).
    """

    name = "scaffold"

    def __init__(
        self,
        *,
        server_lr: float = 1.0,
        total_clients: int | None = None,
        aggregator: Aggregator | None = None,
        sampling: Sampling | None = None,
    ) -> None:
        if total_clients is not None and total_clients < 1:
            raise ValueError(f"total_clients must be at least 1, got {total_clients}")
        super().__init__(
            server_optimizer=ServerSGD(lr=server_lr),
            aggregator=aggregator,
            sampling=sampling,
        )
        self.total_clients = total_clients
        self._live_clients: int | None = None
        self._control: ModelState = OrderedDict()

    def initialize(self, *, initial_state: ModelState) -> None:
        super().initialize(initial_state=initial_state)
        floating, _ = split_names(self.global_state)
        self._control = OrderedDict(
            (n, torch.zeros(self.global_state[n].shape, dtype=compute_dtype(self.global_state[n].dtype)))
            for n in floating
        )
        self._live_clients = None

    @property
    def control_variate(self) -> ModelState:
        """The server control variate ``c`` (float32, or float64 for float64 tensors)."""
        return self._control

    def downlink_state(self, *, server_round: int) -> ModelState:
        out = OrderedDict(self.global_state)
        for name, c in self._control.items():
            out[CONTROL_PREFIX + name] = c.to(self.global_state[name].dtype)
        return out

    def configure_round(
        self, *, server_round: int, clients: Sequence[ClientInfo]
    ) -> list[tuple[ClientInfo, FitIns]]:
        self._live_clients = len(clients)
        expected = TensorSpec.of(self.global_state)
        for name in self._control:
            expected[CONTROL_DELTA_PREFIX + name] = expected[name]
        config = {**self._task_config(server_round), "algorithm": self.name}
        ins = FitIns(round=server_round, config=config, expected=expected)
        return [(client, ins) for client in self.sampling.fit_clients(clients, server_round)]

    def aggregate(
        self, *, server_round: int, results: Sequence[FitRes], failures: Sequence[Failure]
    ) -> dict[str, float]:
        if not results:
            return {}
        ordered = sorted(results, key=lambda r: r.client.sort_key)
        metrics = train_metrics(ordered)
        self._begin_aggregation(server_round)
        try:
            update = self._update_subset(names=list(self.global_state), results=ordered)
            c_step = self._control_step(ordered)
        except AggregationPreconditionError:
            return {**metrics, "aggregation_skipped": 1.0}
        self._state = update
        share = len(ordered) / max(self.total_clients or self._live_clients or len(ordered), len(ordered))
        self._control = OrderedDict((n, c.add(c_step[n], alpha=share)) for n, c in self._control.items())
        return metrics

    def _control_step(self, ordered: Sequence[FitRes]) -> ModelState:
        """The (robust) unweighted mean of the clients' control-variate changes."""
        agg = self.aggregator if self.aggregator is not None else Mean(weighted=False)
        agg.reset()
        for res in ordered:
            delta: ModelState = OrderedDict()
            for name, c in self._control.items():
                got = res.state.get(CONTROL_DELTA_PREFIX + name)
                if got is None or got.shape != c.shape:
                    who = res.client.name or res.client.client_id
                    raise ValueError(
                        f"result from client {who!r}: '{CONTROL_DELTA_PREFIX}{name}' is missing or has the wrong shape"
                    )
                delta[name] = got.detach().to("cpu", c.dtype)
            agg.add(delta, 1.0)
        out = agg.result()
        agg.reset()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "control_variate": OrderedDict((n, held(c)) for n, c in self._control.items()),
            "live_clients": self._live_clients,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        control = state["control_variate"]
        floating, _ = split_names(state["global_state"])
        if list(control) != floating:
            raise ValueError("checkpoint's control variate does not match its model's floating tensors")
        super().load_state_dict(state)
        self._control = OrderedDict((n, c.detach().clone()) for n, c in control.items())
        live = state.get("live_clients")
        self._live_clients = None if live is None else int(live)
