"""A simulation across processes: ``torchrun --nproc-per-node N -m fedgrid.cli simulate ...``.

Every rank builds the whole federation (the same clients, strategy and seeds) and runs the
same round engine; ``ShardedFleet`` gives each rank's ``InProcessFleet`` only the clients
it owns (client ``i`` belongs to rank ``i mod N``), which it trains with its engine
(batched or sequential). After each round's training every rank gathers every rank's
results (``torch.distributed.all_gather_object`` over gloo), puts them back in the order
the assignments name them, and the strategy aggregates them in its canonical order on
every rank, as one process would. The final model is therefore the single-process run's:
bit for bit on the sequential engine at the same thread count (each client trains as it
would alone), and within ``fedgrid.determinism.BATCHED_ATOL`` on the batched engine (whose
float sums depend on which clients share a call).

What a rank keeps of a client (its uplink's error-feedback residuals, its own state
across rounds) stays on the rank that owns it, as a client's own process keeps it. Only
rank 0 writes the run directory. Over-selection (a round that closes when its first
``target`` clients are in) and message phases are not sharded: such a run is refused.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Sequence

import torch.distributed as dist

from fedgrid.errors import ConfigError
from fedgrid.fleet.base import QUORUM_NEEDS_REPLAY, Fleet, Quorum, RoundOutcome
from fedgrid.simulation.fleet import InProcessFleet, simulated_round
from fedgrid.types import (
    ClientInfo,
    EvaluateIns,
    EvaluateRes,
    Failure,
    FitIns,
    FitRes,
    MessageIns,
    MessageRes,
    ModelState,
)

__all__ = ["ShardedFleet"]


class ShardedFleet(Fleet):
    """An ``InProcessFleet`` that trains this rank's share of each round and gathers the rest.

    Args:
        fleet: every client of the simulation (each rank builds the same).
        rank: this process's rank; ``world``: the ranks (the default process group's).
    """

    def __init__(self, fleet: InProcessFleet, *, rank: int, world: int) -> None:
        self.fleet, self.rank, self.world = fleet, rank, world
        self.engine, self.engine_reason = fleet.engine, fleet.engine_reason
        self._infos = {
            info.client_id: info for info in fleet.wait_for_clients(min_clients=0, timeout=timedelta(0))
        }

    @property
    def device(self) -> Any:
        return self.fleet.device

    def mine(self, info: ClientInfo) -> bool:
        """Whether this rank trains ``info``'s client."""
        return self.fleet.index_of(info.client_id) % self.world == self.rank

    def wait_for_clients(self, *, min_clients: int, timeout: timedelta) -> list[ClientInfo]:
        return self.fleet.wait_for_clients(min_clients=min_clients, timeout=timeout)

    def _gather(
        self, outcome: RoundOutcome[Any], assigned: Sequence[ClientInfo], make: Any
    ) -> RoundOutcome[Any]:
        """Every rank's ``outcome`` merged, results and failures in the order of ``assigned``."""
        mine = {
            "results": [(r.client.client_id, make.pack(r)) for r in outcome.results],
            "failures": [(f.client.client_id, f.reason) for f in outcome.failures],
            "bytes": (outcome.bytes_up, outcome.bytes_down),
            "extra": dict(outcome.extra),
        }
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, mine)  # pickles, among this run's own ranks only
        results: dict[str, Any] = {}
        failures: dict[str, str] = {}
        extra: dict[str, float] = {}
        raw = payload = 0.0
        for part in gathered:
            results.update(part["results"])
            failures.update(part["failures"])
            for key, value in part["extra"].items():
                if key == "sim_round_s":
                    extra[key] = max(extra.get(key, 0.0), value)
                elif key == "uplink_ratio":
                    raw_part = sum(make.raw_bytes(state) for cid, state in part["results"])
                    raw, payload = raw + raw_part, payload + raw_part / value
                else:  # per-region bytes: sums
                    extra[key] = extra.get(key, 0.0) + value
        if payload:
            extra["uplink_ratio"] = raw / payload
        order = [info.client_id for info in assigned]
        return RoundOutcome(
            [make.unpack(self._infos[cid], results[cid]) for cid in order if cid in results],
            [Failure(self._infos[cid], failures[cid]) for cid in order if cid in failures],
            bytes_up=sum(p["bytes"][0] for p in gathered),
            bytes_down=sum(p["bytes"][1] for p in gathered),
            extra=extra,
        )

    def fit_round(
        self,
        *,
        server_round: int,
        global_state: ModelState,
        assignments: Sequence[tuple[ClientInfo, FitIns]],
        timeout: timedelta,
        target: int | None = None,
        quorum: Quorum | None = None,
    ) -> RoundOutcome[FitRes]:
        if quorum is not None:  # arrival times decide quorum rounds: simulation replays them
            raise ConfigError("min_quorum", QUORUM_NEEDS_REPLAY)
        if target is not None and target < len(assignments):
            raise ConfigError(
                "over_selection",
                "a simulation sharded across ranks trains every assigned client: over-selection "
                "(a round closing at its first results) is not sharded",
            )
        outcome = self.fleet.fit_round(
            server_round=server_round,
            global_state=global_state,
            assignments=[(i, ins) for i, ins in assignments if self.mine(i)],
            timeout=timeout,
        )
        merged = self._gather(outcome, [info for info, _ in assignments], _FitPacking)
        if "sim_round_s" in merged.extra:  # each rank's results waited for its own slowest: the run's
            round_s = merged.extra["sim_round_s"]
            merged.results[:] = [simulated_round(r, r.metrics["compute_s"], round_s) for r in merged.results]
        return merged

    def evaluate_round(
        self,
        *,
        server_round: int,
        global_state: ModelState,
        assignments: Sequence[tuple[ClientInfo, EvaluateIns]],
        timeout: timedelta,
    ) -> RoundOutcome[EvaluateRes]:
        outcome = self.fleet.evaluate_round(
            server_round=server_round,
            global_state=global_state,
            assignments=[(i, ins) for i, ins in assignments if self.mine(i)],
            timeout=timeout,
        )
        return self._gather(outcome, [info for info, _ in assignments], _EvaluatePacking)

    def message_round(
        self,
        *,
        server_round: int,
        phase: str,
        assignments: Sequence[tuple[ClientInfo, MessageIns]],
        timeout: timedelta,
    ) -> RoundOutcome[MessageRes]:
        raise ConfigError(
            "strategy",
            f"message phase {phase!r}: a simulation sharded across ranks does not relay messages between them",
        )

    def committed(self, server_round: int) -> None:
        self.fleet.committed(server_round)

    def interrupt(self) -> None:
        self.fleet.interrupt()

    def state_dict(self) -> dict[str, Any]:
        return self.fleet.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.fleet.load_state_dict(state)

    def finish(self, *, timeout: timedelta) -> None:
        self.fleet.finish(timeout=timeout)

    def close(self) -> None:
        self.fleet.close()


class _FitPacking:
    @staticmethod
    def pack(r: FitRes) -> Any:
        return (r.state, r.num_examples, dict(r.metrics), r.delta)

    @staticmethod
    def unpack(info: ClientInfo, packed: Any) -> FitRes:
        state, num_examples, metrics, delta = packed
        return FitRes(info, state, num_examples, metrics, delta)

    @staticmethod
    def raw_bytes(packed: Any) -> float:
        return float(sum(t.numel() * t.element_size() for t in packed[0].values()))


class _EvaluatePacking:
    @staticmethod
    def pack(r: EvaluateRes) -> Any:
        return (r.num_examples, dict(r.metrics))

    @staticmethod
    def unpack(info: ClientInfo, packed: Any) -> EvaluateRes:
        return EvaluateRes(info, packed[0], packed[1])

    @staticmethod
    def raw_bytes(packed: Any) -> float:
        return 0.0
