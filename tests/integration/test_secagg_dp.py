"""Differential privacy under SecAgg+ (issue 28): each client clips its update and adds its
share of the noise before masking, so the coordinator's unmasked sum is already noised; the
server's privacy stage adds nothing and only charges the budget."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import threading
from collections import OrderedDict
from datetime import timedelta
from typing import Mapping

import pytest
import torch
from test_secagg import PHASES, Dropping, _schedule, dropping

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.privacy import clip_update, noise_share
from fedgrid.aggregation.secagg import SecAgg
from fedgrid.aggregation.secagg_math import dequantize, ring_add, ring_scale
from fedgrid.client import Client, FitOutput, start_client
from fedgrid.client.secagg import DistributedNoise, seeded_noise, with_secagg
from fedgrid.runlog import RunWriter
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import RoundRules, RunIO, Schedule
from fedgrid.server.privacy import Privacy
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.types import ClientInfo, FitIns, FitRes, ModelState

from harness import wait_until

SIGMA, DP_CLIP, SECAGG_CLIP = 1.0, 0.5, 4.0


def _state() -> ModelState:
    return OrderedDict(
        w=torch.zeros(3, 4), b=torch.zeros(4, dtype=torch.float64), n=torch.zeros((), dtype=torch.int64)
    )


class Step(Client):
    """Adds a seeded step in [-0.5, 0.5) to each floating tensor (norm above the DP clip);
    ``drop[round]`` names the phase at which it is gone for the rest of that round."""

    def __init__(self, name: str, drop: Mapping[int, str]) -> None:
        self.name, self.drop = name, dict(drop)

    @property
    def num_examples(self) -> int:
        return 1 + int(self.name[1:]) % 5  # unequal claims: DP gives every client weight 1

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        seed = int.from_bytes(hashlib.sha256(f"{self.name}/{ins.round}".encode()).digest()[:4], "little")
        gen = torch.Generator().manual_seed(seed)
        out = OrderedDict(
            (n, t + (torch.rand(t.shape, generator=gen, dtype=t.dtype) - 0.5) if t.is_floating_point() else t)
            for n, t in state.items()
        )
        return FitOutput(out, self.num_examples, {"loss": 1.0})


class Recorded(DistributedNoise):
    """``DistributedNoise`` that keeps what it was given and what it returned, by round."""

    def __init__(self, key: bytes) -> None:
        super().__init__(key)
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, update: torch.Tensor, ins: FitIns) -> torch.Tensor:
        out = super().__call__(update, ins)
        self.seen[ins.round] = (update.clone(), out.clone())
        return out


def _federation(n: int, rounds: int, seed: int) -> list[Dropping]:
    """``n`` clients, two of which drop in each round (seeded), at the steps in turn."""
    rng = random.Random(seed)
    drops: dict[int, dict[int, str]] = {i: {} for i in range(n)}
    for r in range(1, rounds + 1):
        for j, i in enumerate(rng.sample(range(n), 2)):
            drops[i][r] = PHASES[(r - 1 + j) % len(PHASES)]
    return dropping([Step(f"c{i:03d}", drops[i]) for i in range(n)], Recorded)  # type: ignore[arg-type]


class Checked(SecAgg):
    """Checks each unmasked sum against the survivors' clipped, noised, quantized inputs."""

    def __init__(self, clients: list[Dropping], **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(FedAvg(), **kwargs)
        self.names = {c.name: c for c in clients}
        self.exact: list[int] = []

    def _finish(self, server_round, answers):  # type: ignore[no-untyped-def]
        out = super()._finish(server_round, answers)
        assert not out.get("secagg_aborted")
        survivors = [self.names[self._selected[cid][0].name] for cid in self.last_survivors]
        t, m = self._round.threshold, len(self._weights)  # type: ignore[union-attr]
        scale = ring_scale(bits=self.bits, clip=self.clip, clients=m) / m  # weight 1/m each
        want = torch.zeros_like(self.last_sum)
        for client in survivors:
            given, noised = client.add_noise.seen[server_round]  # type: ignore[union-attr]
            clipped, norm = clip_update({"u": given}, DP_CLIP)
            assert norm > DP_CLIP and math.isclose(float(clipped["u"].norm()), DP_CLIP, rel_tol=1e-9)
            noise = noise_share(
                client.add_noise.key, server_round, clipped, std=SIGMA * DP_CLIP, parties=t, purpose="secagg"
            )  # type: ignore[union-attr, arg-type]
            assert torch.equal(noised, clipped["u"] + noise["u"])  # bit for bit
            q = client.last_input
            assert q is not None  # within one rounding step of the noised input, never clamped
            assert float((dequantize(q, scale=scale, bits=self.bits) - noised).abs().max()) <= 1 / scale
            want = ring_add(want, q, bits=self.bits)
        assert torch.equal(self.last_sum, want), f"round {server_round}: the unmasked sum is not exact"
        self.exact.append(server_round)
        return out


def _dp_secagg(clients: list, strategy: SecAgg, privacy: Privacy, rounds: int, **io) -> RoundEngine:
    strategy.initialize(initial_state=_state())
    return RoundEngine(
        strategy=strategy, fleet=InProcessFleet(clients), schedule=_schedule(rounds),
        rules=RoundRules(privacy=privacy), io=RunIO(**io),
    )  # fmt: skip


def test_the_unmasked_sum_is_the_survivors_clipped_noised_inputs_bit_for_bit() -> None:
    rounds = 3  # two drops a round, at the steps in turn: every step is covered
    clients = _federation(10, rounds, seed=5)
    strategy = Checked(
        clients, bits=32, clip=SECAGG_CLIP, seed=2, neighbours=6, threshold=4,
        dp_noise_multiplier=SIGMA, dp_clip=DP_CLIP,
    )  # fmt: skip
    privacy = Privacy(noise_multiplier=SIGMA, clip=DP_CLIP, distributed=True)
    engine = _dp_secagg(clients, strategy, privacy, rounds)
    engine.run()
    assert strategy.exact == list(range(1, rounds + 1))
    steps = {p for c in clients for p in c.inner.drop.values()}  # type: ignore[attr-defined]
    assert steps == set(PHASES)
    epsilons = [m.extra["epsilon"] for m in engine.history]
    assert all(m.extra["secagg_aborted"] == 0.0 for m in engine.history)
    assert epsilons == sorted(epsilons) and epsilons[0] > 0 and len(set(epsilons)) == rounds
    assert privacy.accountant.rounds == rounds


def test_each_share_has_std_over_sqrt_t_and_t_shares_sum_to_std() -> None:
    std, t, size = 2.0, 4, 40_000
    ins = FitIns(round=3, config={"dp_clip": 1.0, "dp_noise_std": std, "secagg_threshold": t})
    zero = torch.zeros(size, dtype=torch.float64)
    shares = torch.stack([DistributedNoise()(zero, ins) for _ in range(t)])  # fresh secret keys
    for share in shares:
        assert abs(float(share.mean())) < 5 * std / math.sqrt(t * size)
        assert float(share.std()) == pytest.approx(std / math.sqrt(t), rel=0.02)
    assert float(shares.sum(0).std()) == pytest.approx(std, rel=0.02)  # t survivors: std exactly
    assert abs(float(torch.corrcoef(shares[:2])[0, 1])) < 0.03  # independent keys, independent noise
    # A simulation's keys come from its seed: the same draw again, another client's differs.
    assert torch.equal(seeded_noise(7, "c1")(zero, ins), seeded_noise(7, "c1")(zero, ins))
    assert not torch.equal(seeded_noise(7, "c1")(zero, ins), seeded_noise(7, "c2")(zero, ins))
    # Without DP in the task the update passes unchanged.
    assert DistributedNoise()(zero + 3, FitIns(round=1)).eq(3).all()


def test_the_server_stage_adds_nothing_under_secagg_but_charges_the_round() -> None:
    privacy = Privacy(noise_multiplier=1.0, clip=0.5, distributed=True)
    masked = torch.arange(12, dtype=torch.int32)
    results = [
        FitRes(ClientInfo(client_id=f"c{i}", name=f"c{i}"), OrderedDict(secagg=masked.clone() + i), 1)
        for i in range(4)
    ]
    out, metrics = privacy.apply(1, results, _state(), live=8)
    assert [r.state["secagg"].tolist() for r in out] == [r.state["secagg"].tolist() for r in results]
    assert [r.weight for r in out] == [r.weight for r in results]
    assert metrics["epsilon"] == privacy.accountant.epsilon() > 0 and privacy.accountant.rounds == 1
    assert metrics["dp_clip"] == 0.5
    # An adaptive clip is the strategy's (its clients sum their bits securely): the stage names none.
    adaptive = Privacy(noise_multiplier=1.0, clip=0.5, adaptive=True, distributed=True)
    assert "dp_clip" not in adaptive.apply(1, results, _state(), live=8)[1]


def test_epsilon_is_charged_every_round_and_the_run_stops_before_its_budget(tmp_path) -> None:
    clients = with_secagg([Step(f"c{i}", {}) for i in range(6)], noise_seed=1)  # type: ignore[arg-type]
    assert [c.add_noise.key for c in clients] == [seeded_noise(1, f"c{i}").key for i in range(6)]  # type: ignore[union-attr]
    strategy = SecAgg(FedAvg(), bits=32, clip=SECAGG_CLIP, dp_noise_multiplier=SIGMA, dp_clip=DP_CLIP)
    privacy = Privacy(noise_multiplier=SIGMA, clip=DP_CLIP, epsilon=12.0, distributed=True)
    writer = RunWriter(tmp_path / "run", {})
    engine = _dp_secagg(clients, strategy, privacy, 20, writer=writer)
    final = engine.run()
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epsilons = [row["epsilon"] for row in rows]
    assert 1 <= len(rows) < 20 and epsilons == sorted(epsilons) and epsilons[-1] <= 12.0
    assert all(row["secagg_aborted"] == 0.0 for row in rows)
    assert privacy.accountant.epsilon_after(1.0, SIGMA) > 12.0  # the next round would go over
    assert final is not None and not torch.equal(final["w"], _state()["w"])


def test_a_client_without_a_hook_noises_with_fresh_keys_under_dp() -> None:
    def run() -> ModelState:
        clients = with_secagg([Step(f"c{i}", {}) for i in range(4)])  # type: ignore[arg-type]
        strategy = SecAgg(FedAvg(), bits=32, clip=SECAGG_CLIP, dp_noise_multiplier=SIGMA, dp_clip=DP_CLIP)
        _dp_secagg(
            clients, strategy, Privacy(noise_multiplier=SIGMA, clip=DP_CLIP, distributed=True), 1
        ).run()
        assert all(isinstance(c.add_noise, DistributedNoise) and c.add_noise.key is None for c in clients)
        return strategy.global_state

    first, second = run(), run()
    assert not torch.equal(first["w"], second["w"])  # no one, not even a rerun, can redraw the noise


def test_over_grpc_with_dropouts_the_noised_sums_are_exact_and_charged() -> None:
    clients = _federation(8, 2, seed=11)
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=30))
    server = Coordinator("127.0.0.1:0", fleet, max_workers=16).start()
    strategy = Checked(clients, bits=32, clip=SECAGG_CLIP, seed=1, dp_noise_multiplier=SIGMA, dp_clip=DP_CLIP)
    strategy.initialize(initial_state=_state())
    privacy = Privacy(noise_multiplier=SIGMA, clip=DP_CLIP, distributed=True)
    engine = RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=2,
            min_clients=8,
            round_timeout=timedelta(seconds=60),
            join_timeout=timedelta(seconds=60),
            finish_timeout=timedelta(seconds=10),
        ),
        rules=RoundRules(
            privacy=privacy,
        ),
        io=RunIO(
            events=fleet.events,
        ),
    )
    handles = [start_client(c, server.address, poll_wait_s=1.0) for c in clients]
    try:
        wait_until(lambda: len(fleet.live_clients()) == 8, timeout=30, what="clients to join")
        runner = threading.Thread(target=engine.run, daemon=True)
        runner.start()
        runner.join(timeout=120)
        assert not runner.is_alive()
        assert strategy.exact == [1, 2] and privacy.accountant.rounds == 2
        assert [m.extra["epsilon"] > 0 for m in engine.history] == [True, True]
        for h in handles:
            h.join(timeout=30)
    finally:
        server.stop(grace=0.5)
        fleet.close()


def test_a_dp_task_with_another_threshold_than_the_rounds_is_refused() -> None:
    class Lying(SecAgg):  # asks for noise sized for more survivors than the round unmasks with
        def configure_round(self, *, server_round, clients):  # type: ignore[no-untyped-def]
            out = super().configure_round(server_round=server_round, clients=clients)
            return [
                (info, dataclasses.replace(ins, config={**ins.config, "secagg_threshold": 50}))
                for info, ins in out
            ]

    clients = with_secagg([Step(f"c{i}", {}) for i in range(4)])  # type: ignore[arg-type]
    strategy = Lying(FedAvg(), bits=32, clip=SECAGG_CLIP, dp_noise_multiplier=SIGMA, dp_clip=DP_CLIP)
    engine = _dp_secagg(clients, strategy, Privacy(noise_multiplier=SIGMA, clip=DP_CLIP, distributed=True), 1)
    engine.run()
    assert engine.history[0].extra["secagg_aborted"] == 1.0  # no client uploaded: nothing unmasked
    assert all(c.last_input is None for c in clients)
    assert all(torch.equal(t, _state()[k]) for k, t in strategy.global_state.items())
