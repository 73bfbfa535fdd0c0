"""Simulated client heterogeneity: availability, speed and region, by a stated model.

``ClientProfiles`` answers, for client ``i`` (its position in the federation):

- ``available(i, r)``: client ``i`` takes part in round ``r`` (1-based) when the
  availability trace, if any, lists ``r`` for it, and it does not drop out. Dropouts are
  i.i.d. Bernoulli(``dropout_prob``) per client and round; the draw is
  ``derive_seed(seed, "dropout", i, r) / 2**63 < dropout_prob``, identical in every
  process and independent of the order in which clients are asked.
- ``speed(i)``: relative speed ``s_i``: the number given (``speed = "1.0"``), or
  ``exp(N(0, SIGMA^2))`` for ``lognormal:SIGMA`` (median 1), one draw per client seeded by
  ``derive_seed(seed, "speed", i)``.
- ``train_seconds(i, n) = n * local_epochs / (examples_per_second * s_i)``: simulated time
  for a round of local training on ``n`` examples.
- ``region(i)``: with ``regions = "us:0.5,eu:0.3,ap:0.2"`` the clients are split in those
  shares (counts by largest remainder, so each share is exact to one client) and the
  labels dealt in a permutation seeded by ``derive_seed(seed, "regions")``; empty: ``""``
  (the client keeps its own label).

Availability trace file (``availability_trace``), client indices 0-based, rounds 1-based:

- JSON: an object ``{"0": [1, 2, 5], "3": []}``: client index -> the rounds it is
  available in;
- CSV: rows ``client,round``, one per (client, round) it is available in; a header row
  ``client,round`` is optional; a row ``3,`` lists client 3 with no rounds.

A client the trace does not mention is always available (as far as the trace goes).
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import numpy as np

from fedgrid.errors import ConfigError
from fedgrid.seeding import derive_seed

if TYPE_CHECKING:
    from fedgrid.config import Config

__all__ = ["ClientProfiles", "parse_speed", "parse_regions", "load_trace", "check_heterogeneity"]

_UNIT = float(1 << 63)


def parse_speed(spec: str) -> tuple[str, float]:
    """Parses ``NUMBER`` (every client that speed) or ``lognormal:SIGMA``.

    Raises:
        ConfigError: anything else, a non-positive speed or a negative sigma (names ``speed``).
    """
    name, sep, param = spec.partition(":")
    if sep and name == "lognormal":
        try:
            sigma = float(param)
        except ValueError:
            raise ConfigError("speed", f"lognormal needs a number, got {param!r}") from None
        if not 0.0 <= sigma < math.inf:
            raise ConfigError("speed", f"lognormal sigma must be finite and at least 0, got {sigma}")
        return "lognormal", sigma
    try:
        value = float(spec)
    except ValueError:
        raise ConfigError("speed", f"expected a number or lognormal:SIGMA, got {spec!r}") from None
    if not 0.0 < value < math.inf:
        raise ConfigError("speed", f"must be positive and finite, got {value}")
    return "constant", value


def parse_regions(spec: str) -> list[tuple[str, float]]:
    """Parses ``LABEL:SHARE,...`` (shares positive, normalized to sum to 1); empty: none.

    Raises:
        ConfigError: a malformed entry, a repeated label or a non-positive share (names ``regions``).
    """
    if not spec.strip():
        return []
    out: dict[str, float] = {}
    for entry in spec.split(","):
        label, sep, share_s = entry.strip().partition(":")
        label = label.strip()
        try:
            share = float(share_s) if sep else math.nan
        except ValueError:
            share = math.nan
        if not label or not 0.0 < share < math.inf:
            raise ConfigError("regions", f"expected LABEL:SHARE with a positive share, got {entry.strip()!r}")
        if label in out:
            raise ConfigError("regions", f"region {label!r} is listed twice")
        out[label] = share
    total = sum(out.values())
    return [(label, share / total) for label, share in out.items()]


def load_trace(path: str | Path) -> dict[int, frozenset[int]]:
    """Reads an availability trace (JSON or CSV, see the module docstring).

    Raises:
        ConfigError: unreadable file or malformed content (names ``availability_trace``).
    """
    key = "availability_trace"
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(key, f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    trace: dict[int, set[int]] = {}

    def add(client: object, rounds: list[object]) -> None:
        try:
            index = int(str(client).strip())
            parsed = {int(str(r).strip()) for r in rounds}
        except ValueError:
            raise ConfigError(
                key, f"{path}: client indices and rounds must be whole numbers, got {client!r}: {rounds!r}"
            ) from None
        if index < 0 or any(r < 1 for r in parsed):
            raise ConfigError(
                key, f"{path}: client indices start at 0 and rounds at 1, got {index}: {sorted(parsed)}"
            )
        trace.setdefault(index, set()).update(parsed)

    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(key, f"{path} is not valid JSON: {exc}") from None
        for client, rounds in data.items():
            if not isinstance(rounds, list):
                raise ConfigError(key, f"{path}: client {client!r} needs a list of rounds, got {rounds!r}")
            add(client, rounds)
    else:
        for line, row in enumerate(csv.reader(io.StringIO(text)), start=1):
            cells = [c.strip() for c in row]
            if not any(cells) or (line == 1 and cells[:2] == ["client", "round"]):
                continue
            if len(cells) != 2:
                raise ConfigError(key, f"{path}:{line}: expected client,round, got {','.join(row)!r}")
            add(cells[0], [cells[1]] if cells[1] else [])
    return {i: frozenset(r) for i, r in trace.items()}


def check_heterogeneity(config: "Config") -> None:
    """Checks the heterogeneity keys of ``config`` (reads the trace file).

    Raises:
        ConfigError: a bad value, naming its key.
    """
    if not 0.0 <= config.dropout_prob < 1.0:
        raise ConfigError("dropout_prob", f"must be in [0, 1), got {config.dropout_prob}")
    parse_speed(config.speed)
    parse_regions(config.regions)
    if config.availability_trace:
        load_trace(config.availability_trace)


class ClientProfiles:
    """Availability, speed and region of ``num_clients`` simulated clients (see the module docstring).

    Args:
        num_clients: the federation's size (region shares are dealt over it).
        seed: the run's seed.
        dropout_prob: per client and round probability of being unavailable, in [0, 1).
        trace: client index -> the rounds it is available in (clients absent: always).
        speed: ``NUMBER`` or ``lognormal:SIGMA``.
        regions: ``LABEL:SHARE,...``, or empty.
        examples_per_second: training rate of a client of speed 1.
        local_epochs: passes over its data a client makes per round.

    Raises:
        ConfigError: a bad value, naming its key.
    """

    def __init__(
        self,
        num_clients: int,
        *,
        seed: int = 0,
        dropout_prob: float = 0.0,
        trace: Mapping[int, frozenset[int]] | None = None,
        speed: str = "1.0",
        regions: str = "",
        examples_per_second: float = 1000.0,
        local_epochs: int = 1,
    ) -> None:
        if num_clients < 1:
            raise ConfigError("clients", f"must be at least 1, got {num_clients}")
        if not 0.0 <= dropout_prob < 1.0:
            raise ConfigError("dropout_prob", f"must be in [0, 1), got {dropout_prob}")
        if not 0.0 < examples_per_second < math.inf:
            raise ConfigError("examples_per_second", f"must be positive, got {examples_per_second}")
        if local_epochs < 1:
            raise ConfigError("local_epochs", f"must be at least 1, got {local_epochs}")
        self.num_clients = num_clients
        self.seed = seed
        self.dropout_prob = dropout_prob
        self.trace: dict[int, frozenset[int]] = dict(trace or {})
        self.examples_per_second = examples_per_second
        self.local_epochs = local_epochs
        kind, value = parse_speed(speed)
        if kind == "constant":
            self._speeds = np.full(num_clients, value)
        else:
            self._speeds = np.array(
                [
                    np.random.default_rng(derive_seed(seed, "speed", i)).lognormal(0.0, value)
                    for i in range(num_clients)
                ]
            )
        self._regions = self._deal_regions(parse_regions(regions))

    @classmethod
    def from_config(cls, config: "Config", num_clients: int | None = None) -> "ClientProfiles":
        """Profiles for ``num_clients`` (default ``config.clients``) from the config's keys."""
        return cls(
            config.clients if num_clients is None else num_clients,
            seed=config.seed,
            dropout_prob=config.dropout_prob,
            trace=load_trace(config.availability_trace) if config.availability_trace else None,
            speed=config.speed,
            regions=config.regions,
            examples_per_second=config.examples_per_second,
            local_epochs=config.local_epochs,
        )

    def _deal_regions(self, shares: list[tuple[str, float]]) -> list[str]:
        if not shares:
            return [""] * self.num_clients
        exact = [share * self.num_clients for _, share in shares]
        counts = [math.floor(x) for x in exact]
        # Largest remainder; ties go to the region listed first.
        for j in sorted(range(len(shares)), key=lambda j: (-(exact[j] - counts[j]), j))[
            : self.num_clients - sum(counts)
        ]:
            counts[j] += 1
        labels = np.array([label for (label, _), n in zip(shares, counts) for _ in range(n)], dtype=object)
        order = np.random.default_rng(derive_seed(self.seed, "regions")).permutation(self.num_clients)
        return [str(x) for x in labels[order]]

    @property
    def homogeneous(self) -> bool:
        """Every client always available, of speed 1, without a region label."""
        return (
            self.dropout_prob == 0.0
            and not self.trace
            and bool(np.all(self._speeds == 1.0))
            and not any(self._regions)
        )

    def _check(self, index: int) -> None:
        if not 0 <= index < self.num_clients:
            raise IndexError(f"client index {index} is outside 0..{self.num_clients - 1}")

    def available(self, index: int, server_round: int) -> bool:
        """Whether client ``index`` takes part in round ``server_round`` (1-based)."""
        self._check(index)
        rounds = self.trace.get(index)
        if rounds is not None and server_round not in rounds:
            return False
        if self.dropout_prob == 0.0:
            return True
        return derive_seed(self.seed, "dropout", index, server_round) / _UNIT >= self.dropout_prob

    def speed(self, index: int) -> float:
        """Relative speed of client ``index`` (1: ``examples_per_second``)."""
        self._check(index)
        return float(self._speeds[index])

    def region(self, index: int) -> str:
        """Region label of client ``index`` (``""``: none assigned)."""
        self._check(index)
        return self._regions[index]

    def train_seconds(self, index: int, num_examples: int) -> float:
        """Simulated seconds client ``index`` trains a round on ``num_examples`` examples."""
        return num_examples * self.local_epochs / (self.examples_per_second * self.speed(index))
