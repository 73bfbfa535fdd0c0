"""FedProx (Li et al. 2020), server side: FedAvg aggregation; the task config carries
``proximal_mu``, and the client adds ``mu / 2 * ||w - w_global||^2`` to its loss.
"""

from __future__ import annotations

from fedgrid.aggregation.base import Aggregator
from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.selection import Sampling
from fedgrid.types import Scalar

__all__ = ["FedProx"]


class FedProx(FedAvg):
    """FedProx's server: FedAvg that sends ``proximal_mu`` with every task.

    Task config: ``algorithm = "fedprox"``, ``proximal_mu``.

    Args:
        proximal_mu: the proximal coefficient mu (>= 0; 0 is FedAvg).
        aggregator, sampling: as ``FedAvg`` (which clients a round asks).

    Raises:
        ValueError: ``proximal_mu`` is negative or not finite.
    """

    name = "fedprox"

    def __init__(
        self,
        *,
        proximal_mu: float = 0.01,
        aggregator: Aggregator | None = None,
        sampling: Sampling | None = None,
        lora_aggregation: str = "factors",
    ) -> None:
        if not (proximal_mu >= 0 and proximal_mu != float("inf")):
            raise ValueError(f"proximal_mu must be non-negative and finite, got {proximal_mu}")
        super().__init__(
            sampling=sampling,
            aggregator=aggregator,
            lora_aggregation=lora_aggregation,
        )
        self.proximal_mu = float(proximal_mu)

    def _task_config(self, server_round: int) -> dict[str, Scalar]:
        return {**super()._task_config(server_round), "algorithm": self.name, "proximal_mu": self.proximal_mu}
