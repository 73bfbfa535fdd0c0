"""SecAgg+ rounds through the round engine: in the simulated fleet and over gRPC (an
in-process coordinator on port 0 and client runtimes), with clients dropping at every step.
The unmasked sum equals the survivors' plaintext quantized inputs bit for bit; below the
threshold the round aborts and the model is kept."""

from __future__ import annotations

import hashlib
import random
import threading
from collections import OrderedDict
from datetime import timedelta
from typing import Callable, Mapping

import pytest
import torch

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.secagg import ADVERTISE, SHARE, UNMASK, SecAgg
from fedgrid.aggregation.secagg_math import dequantize, ring_add, ring_scale
from fedgrid.client import Client, FitOutput, start_client
from fedgrid.client.secagg import NoiseHook, SecAggClient, with_secagg
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import RunIO, Schedule
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.types import FIT, FitIns, MessageIns, ModelState

from harness import wait_until

PHASES = (ADVERTISE, SHARE, FIT, UNMASK)


def _schedule(rounds: int) -> Schedule:
    return Schedule(
        rounds=rounds, min_clients=1, round_timeout=timedelta(seconds=60), join_timeout=timedelta(seconds=10)
    )


def _state() -> ModelState:
    return OrderedDict(
        w=torch.zeros(3, 4), b=torch.zeros(4, dtype=torch.float64), steps=torch.zeros((), dtype=torch.int64)
    )


class Step(Client):
    """Adds a seeded step in [-0.3, 0.3) to each floating tensor; ``drop[round]`` names the
    phase at which it is gone for the rest of that round."""

    def __init__(self, name: str, examples: int, drop: Mapping[int, str]) -> None:
        self.name, self._examples, self.drop = name, examples, dict(drop)

    @property
    def num_examples(self) -> int:
        return self._examples

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        seed = int.from_bytes(hashlib.sha256(f"{self.name}/{ins.round}".encode()).digest()[:4], "little")
        gen = torch.Generator().manual_seed(seed)
        out = OrderedDict(
            (
                n,
                t + (torch.rand(t.shape, generator=gen, dtype=t.dtype) * 0.6 - 0.3)
                if t.is_floating_point()
                else t,
            )
            for n, t in state.items()
        )
        return FitOutput(out, self._examples, {"loss": 1.0})


class Dropping(SecAggClient):
    """A ``SecAggClient`` that fails (as a lost connection) from its step ``inner.drop[round]`` on."""

    def _gone(self, server_round: int, phase: str) -> None:
        step = self.inner.drop.get(server_round)  # type: ignore[attr-defined]
        if step is not None and PHASES.index(phase) >= PHASES.index(step):
            raise ConnectionError(f"{self.name} gone at {step}")

    def exchange(self, ins: MessageIns):  # type: ignore[no-untyped-def]
        self._gone(ins.round, ins.phase)
        return super().exchange(ins)

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        self._gone(ins.round, FIT)
        return super().fit(state, ins)


def _federation(n: int, rounds: int, rate: float, seed: int) -> list[Dropping]:
    """``n`` clients; in each round ``rate`` of them (at least one, drawn at random, seeded)
    drop, at the steps in turn (so that a few rounds cover every step)."""
    rng = random.Random(seed)
    drops: dict[int, dict[int, str]] = {i: {} for i in range(n)}
    for r in range(1, rounds + 1):
        for j, i in enumerate(rng.sample(range(n), max(1, round(rate * n)))):
            drops[i][r] = PHASES[(r - 1 + j) % len(PHASES)]
    return dropping([Step(f"c{i:03d}", 1 + i % 5, drops[i]) for i in range(n)])


def dropping(plain: list, noise: Callable[[bytes], NoiseHook] | None = None) -> list[Dropping]:
    """``plain`` clients as ``Dropping`` SecAgg+ clients; with ``noise``, each one's DP noise
    hook is ``noise(key)``, keyed by the hash of its name."""
    return [
        Dropping(
            c.inner,
            signer=c.party.signer,
            keyring=c.party.keyring,
            add_noise=None if noise is None else noise(hashlib.sha256(c.name.encode()).digest()),
        )
        for c in with_secagg(plain)
    ]


class Checked(SecAgg):
    """Checks each unmasked sum against the survivors' plaintext quantized inputs."""

    def __init__(self, clients: list[Dropping], **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(FedAvg(), **kwargs)
        self.by_id: dict[str, Dropping] = {}
        self.names = {c.name: c for c in clients}
        self.exact: list[int] = []

    def _finish(self, server_round, answers):  # type: ignore[no-untyped-def]
        before = self.global_state
        out = super()._finish(server_round, answers)
        if out.get("secagg_aborted"):
            assert all(torch.equal(before[k], self.global_state[k]) for k in before)
            return out
        want = torch.zeros_like(self.last_sum)
        for cid in self.last_survivors:
            inputs = self.names[self._selected[cid][0].name].last_input
            assert inputs is not None
            want = ring_add(want, inputs, bits=self.bits)
        assert torch.equal(self.last_sum, want), f"round {server_round}: the unmasked sum is not exact"
        self.exact.append(server_round)
        return out


@pytest.mark.parametrize("n", [10, 50])
def test_simulated_rounds_are_exact_with_dropouts_at_every_step(n: int) -> None:
    rounds = 4
    clients = _federation(n, rounds, rate=0.1, seed=n)
    strategy = Checked(clients, bits=32, clip=0.5, seed=3)
    strategy.initialize(initial_state=_state())
    engine = RoundEngine(strategy=strategy, fleet=InProcessFleet(clients), schedule=_schedule(rounds))
    engine.run()
    assert strategy.exact == list(range(1, rounds + 1))
    steps = {p for c in clients for p in c.inner.drop.values()}  # type: ignore[attr-defined]
    assert steps == set(PHASES)
    assert all(m.extra["secagg_aborted"] == 0.0 for m in engine.history)
    assert [m.extra["secagg_survivors"] for m in engine.history] == [
        n - sum(1 for c in clients if c.inner.drop.get(r) in (ADVERTISE, SHARE, FIT))
        for r in range(1, rounds + 1)  # type: ignore[attr-defined]
    ]


def test_the_model_moves_by_the_survivors_weighted_mean() -> None:
    clients = _federation(10, 1, rate=0.0, seed=0)  # one client drops (at least one is drawn)
    strategy = Checked(clients, bits=32, clip=0.5)
    strategy.initialize(initial_state=_state())
    RoundEngine(strategy=strategy, fleet=InProcessFleet(clients), schedule=_schedule(1)).run()
    alive = {strategy._selected[cid][0].name for cid in strategy.last_survivors}  # noqa: SLF001
    start = _state()
    ins = FitIns(round=1)
    fits = {c.name: c.inner.fit(start, ins) for c in clients if c.name in alive}
    total = sum(c.num_examples for c in clients if c.name in alive)
    for name in ("w", "b"):
        mean = sum(fits[c].state[name].double() * fits[c].num_examples for c in fits) / total
        assert torch.allclose(strategy.global_state[name].double(), mean, atol=1e-6)
    assert torch.equal(strategy.global_state["steps"], start["steps"])


def test_below_the_threshold_the_round_aborts_and_keeps_the_model() -> None:
    plain = [Step(f"c{i}", 1, {1: FIT} if i < 6 else {}) for i in range(10)]
    clients = [Dropping(c.inner, signer=c.party.signer, keyring=c.party.keyring) for c in with_secagg(plain)]  # type: ignore[arg-type]
    strategy = Checked(clients, bits=32, clip=0.5, neighbours=8, threshold=5)
    strategy.initialize(initial_state=_state())
    engine = RoundEngine(strategy=strategy, fleet=InProcessFleet(clients), schedule=_schedule(1))
    engine.run()
    assert engine.history[0].extra["secagg_aborted"] == 1.0
    assert strategy.exact == []
    assert all(torch.equal(t, _state()[k]) for k, t in strategy.global_state.items())


def test_int8_masked_upload_costs_what_an_int8_upload_does() -> None:
    clients = with_secagg([Step(f"c{i}", 1, {}) for i in range(6)])  # type: ignore[arg-type]
    strategy = SecAgg(FedAvg(), bits=8, clip=0.5)
    strategy.initialize(initial_state=_state())
    engine = RoundEngine(strategy=strategy, fleet=InProcessFleet(clients), schedule=_schedule(1))
    engine.run()
    m = engine.history[0]
    phases = sum(m.extra[f"{p}_bytes_up"] for p in (ADVERTISE, SHARE, UNMASK))
    fit_up = m.bytes_up - phases
    assert fit_up <= 6 * (16 + 200)  # 16 ring bytes a client, and the upload's framing
    assert clients[0].last_input is not None and clients[0].last_input.numel() == 16
    # The mean of 6 clients within 8-bit rounding of the plain mean.
    scale = ring_scale(bits=8, clip=0.5, clients=6)
    plain = sum(c.inner.fit(_state(), FitIns(round=1)).state["w"] for c in clients) / 6
    assert float((strategy.global_state["w"] - plain).abs().max()) <= 6 / scale
    assert dequantize(torch.tensor([255]), scale=scale, bits=8).item() == -1 / scale


def test_over_grpc_with_dropouts_the_sums_are_exact() -> None:
    rounds = 2
    clients = _federation(10, rounds, rate=0.3, seed=7)
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=30))
    server = Coordinator("127.0.0.1:0", fleet, max_workers=16).start()
    strategy = Checked(clients, bits=32, clip=0.5, seed=1)
    strategy.initialize(initial_state=_state())
    engine = RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=rounds,
            min_clients=10,
            round_timeout=timedelta(seconds=60),
            join_timeout=timedelta(seconds=60),
            finish_timeout=timedelta(seconds=10),
        ),
        io=RunIO(
            events=fleet.events,
        ),
    )
    handles = [start_client(c, server.address, poll_wait_s=1.0) for c in clients]
    try:
        wait_until(lambda: len(fleet.live_clients()) == 10, timeout=30, what="clients to join")
        runner = threading.Thread(target=engine.run, daemon=True)
        runner.start()
        runner.join(timeout=120)
        assert not runner.is_alive()
        assert strategy.exact == [1, 2]
        assert {p for c in clients for p in c.inner.drop.values()} == set(PHASES)  # type: ignore[attr-defined]
        for h in handles:
            h.join(timeout=30)
    finally:
        server.stop(grace=0.5)
        fleet.close()


def test_simulated_regions_aggregate_securely_inside_and_send_one_update_up() -> None:
    from fedgrid.config import load_config
    from fedgrid.simulation import run as sim_run
    from fedgrid.simulation.heterogeneity import ClientProfiles

    config = load_config(
        overrides={
            "secagg": True, "hierarchy": True, "regions": "eu:0.5,us:0.5", "clients": 8, "rounds": 1,
            "lan_codec": "int8", "codec": "topk:0.1",
        }
    )  # fmt: skip
    clients = with_secagg([Step(f"c{i}", 1, {}) for i in range(8)])  # type: ignore[arg-type]
    regions = sim_run._regions(config, list(clients), ClientProfiles.from_config(config))  # noqa: SLF001
    assert [r.name for r in regions] == ["eu", "us"]
    for region in regions:
        out = region.fit(_state(), FitIns(round=1))  # one update upstream: the region's model
        strategy = region.engine.strategy
        assert isinstance(strategy, SecAgg) and strategy.bits == 8
        (metrics,) = region.engine.history
        assert metrics.extra["secagg_aborted"] == 0.0
        assert metrics.extra["secagg_survivors"] == metrics.clients_ok == 4
        assert torch.equal(out.state["w"], strategy.global_state["w"])
        assert not torch.equal(out.state["w"], _state()["w"])


def test_the_noise_hook_perturbs_each_clipped_update_before_masking() -> None:
    seen: list[int] = []

    def add_noise(update: torch.Tensor, ins: FitIns) -> torch.Tensor:
        seen.append(ins.round)
        return update + 0.125  # a client's share of distributed noise (here a constant, to check it)

    plain = [Step(f"c{i}", 1, {}) for i in range(4)]
    quiet = with_secagg(plain)  # type: ignore[arg-type]
    noisy = with_secagg(plain, add_noise=add_noise)  # type: ignore[arg-type]
    models = []
    for clients in (quiet, noisy):
        strategy = SecAgg(FedAvg(), bits=32, clip=0.5)
        strategy.initialize(initial_state=_state())
        RoundEngine(strategy=strategy, fleet=InProcessFleet(clients), schedule=_schedule(1)).run()
        models.append(strategy.global_state)
    assert seen == [1, 1, 1, 1]
    for name in ("w", "b"):
        assert torch.allclose(
            models[1][name].double() - models[0][name].double(),
            torch.tensor(0.125, dtype=torch.float64),
            atol=1e-6,
        )
