"""Client selection: how many clients a round asks, how many it waits for, and which.

``Sampling`` is what a strategy holds of it: the share of clients a round asks, the fewest,
the share that evaluates, the seed of the draws, the scalars every task carries, and a
``SelectionPolicy``. Strategies hold one rather than inherit it, so a strategy of one's own
need not subclass ``FedAvg`` to be sampled as the coordinator is configured.

``SelectionPolicy`` says how many: a fixed count per round or a fraction of the live
clients, plus over-selection (ask more than needed; the round closes as soon as the target
count has reported, or at its deadline). A ``Selector`` says which: uniformly at random by
default, balanced across regions, or only among clients with the capabilities a task needs.
Selectors are pure and seeded: the same live clients and seed give the same choice.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from fedgrid.seeding import derive_seed
from fedgrid.types import ClientInfo, Scalar

__all__ = [
    "Selector",
    "UniformSelector",
    "RegionBalancedSelector",
    "CapabilityFilter",
    "SelectionPolicy",
    "Sampling",
]


class Selector(ABC):
    """Chooses ``count`` of ``clients`` (given sorted by ``sort_key``)."""

    @abstractmethod
    def select(self, clients: Sequence[ClientInfo], count: int, rng: random.Random) -> list[ClientInfo]:
        """Returns at most ``count`` distinct clients."""


@dataclass(frozen=True)
class UniformSelector(Selector):
    """Every client equally likely."""

    def select(self, clients: Sequence[ClientInfo], count: int, rng: random.Random) -> list[ClientInfo]:
        return list(clients) if count >= len(clients) else rng.sample(list(clients), count)


@dataclass(frozen=True)
class RegionBalancedSelector(Selector):
    """Round-robin over regions (in random order), uniformly within each: every region is
    represented in proportion as equal as the count allows."""

    def select(self, clients: Sequence[ClientInfo], count: int, rng: random.Random) -> list[ClientInfo]:
        by_region: dict[str, list[ClientInfo]] = {}
        for client in clients:
            by_region.setdefault(client.region, []).append(client)
        pools = [rng.sample(members, len(members)) for _, members in sorted(by_region.items())]
        rng.shuffle(pools)
        chosen: list[ClientInfo] = []
        while len(chosen) < count and any(pools):
            for pool in pools:
                if pool and len(chosen) < count:
                    chosen.append(pool.pop())
        return chosen


@dataclass(frozen=True)
class CapabilityFilter(Selector):
    """Only clients that meet every stated requirement; ``inner`` chooses among them.

    The coordinator's ``require_device``, ``min_accelerators`` and ``min_client_memory``
    keys build one (``fedgrid.server.strategies.build_capability_filter``), which the fleet
    applies before the strategy sees any client: a round waits for ``min_clients``
    *qualifying* clients and ``fraction_fit`` is a share of those.

    Attributes:
        min_memory_bytes: least ``memory_bytes`` reported.
        min_accelerators: least ``num_accelerators`` reported.
        regions: the regions allowed (empty: any).
        devices: the device types allowed (empty: any).
        inner: chooses among the qualifying clients.
    """

    min_memory_bytes: int = 0
    min_accelerators: int = 0
    regions: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    inner: Selector = field(default_factory=UniformSelector)

    def eligible(self, client: ClientInfo) -> bool:
        """Whether ``client`` meets every requirement."""
        return self.shortfall(client) is None

    def shortfall(self, client: ClientInfo) -> str | None:
        """The first requirement ``client`` misses, in words (``None``: it meets them all)."""
        if self.devices and client.device not in self.devices:
            return f"device {client.device!r} is not {' or '.join(map(repr, self.devices))}"
        if client.num_accelerators < self.min_accelerators:
            return f"{client.num_accelerators} accelerators, fewer than {self.min_accelerators}"
        if client.memory_bytes < self.min_memory_bytes:
            return f"memory {client.memory_bytes} bytes, less than {self.min_memory_bytes}"
        if self.regions and client.region not in self.regions:
            return f"region {client.region!r} is not {' or '.join(map(repr, self.regions))}"
        return None

    def select(self, clients: Sequence[ClientInfo], count: int, rng: random.Random) -> list[ClientInfo]:
        return self.inner.select([c for c in clients if self.eligible(c)], count, rng)


@dataclass(frozen=True)
class SelectionPolicy:
    """How many clients a round asks and waits for.

    Attributes:
        clients_per_round: target count of results per round; 0 means ``fraction_fit`` of
            the live clients.
        over_selection: ask ``ceil(target * (1 + over_selection))`` clients and close the round
            once ``target`` have reported (the rest are cancelled, their late uploads refused).
        selector: which clients; uniform by default.
    """

    clients_per_round: int = 0
    over_selection: float = 0.0
    selector: Selector = field(default_factory=UniformSelector)

    def __post_init__(self) -> None:
        if self.clients_per_round < 0:
            raise ValueError(f"clients_per_round must be at least 0, got {self.clients_per_round}")
        if not 0.0 <= self.over_selection <= 10.0:
            raise ValueError(f"over_selection must be in [0, 10], got {self.over_selection}")

    def target(self, *, num_live: int, fraction: float, minimum: int) -> int:
        """Results a round waits for, out of ``num_live`` clients."""
        wanted = self.clients_per_round or max(minimum, int(fraction * num_live))  # floor, as Flower
        return min(wanted, num_live)

    def asked(self, target: int, num_live: int) -> int:
        """Clients a round asks, over-selection included."""
        return min(num_live, math.ceil(target * (1.0 + self.over_selection)))


@dataclass(frozen=True)
class Sampling:
    """Which clients a round asks and waits for, and what every task carries.

    Attributes:
        fraction_fit: share of live clients asked each round (at least ``min_fit_clients``).
        min_fit_clients: fewest clients a round asks.
        fraction_evaluate: share of live clients asked to evaluate each new global model on
            their own data (federated evaluation); 0 turns it off.
        seed: seeds the draws, so a run's selection is reproducible.
        fit_config: scalars sent with every task (``local_epochs``, ``lr``, ...).
        policy: a fixed count per round, over-selection, the selector.

    Raises:
        ValueError: a value out of range (named).
    """

    fraction_fit: float = 1.0
    min_fit_clients: int = 1
    fraction_evaluate: float = 0.0
    seed: int = 0
    fit_config: Mapping[str, Scalar] = field(default_factory=dict)
    policy: SelectionPolicy = field(default_factory=SelectionPolicy)

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction_fit <= 1.0:
            raise ValueError(f"fraction_fit must be in (0, 1], got {self.fraction_fit}")
        if self.min_fit_clients < 1:
            raise ValueError(f"min_fit_clients must be at least 1, got {self.min_fit_clients}")
        if not 0.0 <= self.fraction_evaluate <= 1.0:
            raise ValueError(f"fraction_evaluate must be in [0, 1], got {self.fraction_evaluate}")
        object.__setattr__(self, "fit_config", dict(self.fit_config))

    def with_seed(self, seed: int) -> Sampling:
        """The same sampling, drawing from ``seed`` (a resumed run's)."""
        return replace(self, seed=seed)

    def clients_per_round(self, num_clients: int) -> int:
        """How many results a round with ``num_clients`` live clients waits for."""
        return self.policy.target(
            num_live=num_clients, fraction=self.fraction_fit, minimum=self.min_fit_clients
        )

    def sample(
        self, clients: Sequence[ClientInfo], count: int, server_round: int, salt: int
    ) -> list[ClientInfo]:
        """``count`` of ``clients`` drawn for ``server_round`` (``salt`` tells draws of one round
        apart), in canonical order; the same clients, round and seed give the same draw."""
        ordered = sorted(clients, key=lambda c: c.sort_key)
        rng = random.Random(derive_seed("sample", self.seed, server_round, salt))
        return sorted(self.policy.selector.select(ordered, count, rng), key=lambda c: c.sort_key)

    def fit_clients(self, clients: Sequence[ClientInfo], server_round: int) -> list[ClientInfo]:
        """The clients a fit round asks: the target count plus over-selection."""
        asked = self.policy.asked(self.clients_per_round(len(clients)), len(clients))
        return self.sample(clients, asked, server_round, 0)

    def evaluate_clients(self, clients: Sequence[ClientInfo], server_round: int) -> list[ClientInfo]:
        """The clients asked to evaluate after ``server_round`` (none when ``fraction_evaluate`` is 0)."""
        if self.fraction_evaluate == 0.0:
            return []
        count = min(len(clients), max(1, int(self.fraction_evaluate * len(clients))))
        return self.sample(clients, count, server_round, 1)

    def task_config(self, server_round: int) -> dict[str, Scalar]:
        """The scalars every task of ``server_round`` carries."""
        return {**self.fit_config, "round": server_round, "seed": self.seed}
