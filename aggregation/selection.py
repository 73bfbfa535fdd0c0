"""Client selection: how many clients a round asks, how many it waits for, and which.

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
from dataclasses import dataclass, field
from typing import Sequence

from fedgrid.types import ClientInfo

__all__ = ["Selector", "UniformSelector", "RegionBalancedSelector", "CapabilityFilter", "SelectionPolicy"]


class Selector(ABC):
    """Chooses ``count`` of ``clients`` (given sorted by ``sort_key``)."""

    @abstractmethod
    def select(self, clients: Sequence[ClientInfo], count: int, rng: random.Random) -> list[ClientInfo]:
        """Returns at most ``count`` distinct clients."""


class UniformSelector(Selector):
    """Every client equally likely."""

    def select(self, clients: Sequence[ClientInfo], count: int, rng: random.Random) -> list[ClientInfo]:
        return list(clients) if count >= len(clients) else rng.sample(list(clients), count)


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
