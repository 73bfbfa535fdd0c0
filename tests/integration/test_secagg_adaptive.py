"""Adaptive clipping (Andrew et al.) under SecAgg+: each client appends its unclipped bit plus
its share of the count's noise as one more masked coordinate; the coordinator unmasks only the
survivors' noised count, and the next round's clip is the server-side formula's
(``privacy.next_clip``) on that count, with clients dropping before and after masking."""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from datetime import timedelta

import torch
from test_secagg import Dropping, dropping

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.privacy import next_clip, split_noise
from fedgrid.aggregation.secagg import COUNT_SCALE, UNMASK, SecAgg
from fedgrid.aggregation.secagg_math import dequantize, ring_add, ring_scale
from fedgrid.client import Client, FitOutput
from fedgrid.client.secagg import DistributedNoise, with_secagg
from fedgrid.config import load_config
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import RoundRules, Schedule
from fedgrid.server.privacy import Privacy
from fedgrid.server.state_codec import decode_state, encode_state
from fedgrid.server.strategies import build_strategy
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.types import FIT, FitIns, ModelState

SIGMA, CLIP0, SECAGG_CLIP, ROUNDS = 1.0, 0.5, 4.0, 4


def _state() -> ModelState:
    return OrderedDict(w=torch.zeros(3, 4), b=torch.zeros(4, dtype=torch.float64))


class Sized(Client):
    """Steps of L2 norm ``norm`` (a seeded direction): some under the clip, some over it."""

    def __init__(self, name: str, norm: float, drop: dict[int, str]) -> None:
        self.name, self.norm, self.drop = name, norm, drop

    @property
    def num_examples(self) -> int:
        return 1

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        seed = int.from_bytes(hashlib.sha256(f"{self.name}/{ins.round}".encode()).digest()[:4], "little")
        gen = torch.Generator().manual_seed(seed)
        steps = {n: torch.randn(t.shape, generator=gen, dtype=torch.float64) for n, t in state.items()}
        total = math.sqrt(sum(float(s.square().sum()) for s in steps.values()))
        out = OrderedDict((n, t + (steps[n] * self.norm / total).to(t.dtype)) for n, t in state.items())
        return FitOutput(out, 1, {"loss": 1.0})


class Counted(DistributedNoise):
    """``DistributedNoise`` that keeps each round's count coordinate (bit + noise share) and task."""

    def __init__(self, key: bytes) -> None:
        super().__init__(key)
        self.counts: dict[int, tuple[bool, float, FitIns]] = {}

    def count(self, unclipped: bool, ins: FitIns) -> float:
        value = super().count(unclipped, ins)
        self.counts[ins.round] = (unclipped, value, ins)
        return value


class Checked(SecAgg):
    """Checks each round's unmasked count and the next clip against the survivors' plaintext."""

    def __init__(self, clients: list[Dropping], **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(FedAvg(), **kwargs)
        self.names = {c.name: c for c in clients}
        self.checked: list[tuple[int, float, int, int]] = []  # round, clip, unclipped, survivors

    def _finish(self, server_round, answers):  # type: ignore[no-untyped-def]
        clip = self.dp_clip
        out = super()._finish(server_round, answers)
        assert not out.get("secagg_aborted")
        survivors = [self.names[self._selected[cid][0].name] for cid in self.last_survivors]
        want = torch.zeros_like(self.last_sum)
        for c in survivors:
            want = ring_add(want, c.last_input, bits=self.bits)  # type: ignore[arg-type]
        assert torch.equal(self.last_sum, want)  # the count coordinate too, bit for bit
        counts = [c.add_noise.counts[server_round] for c in survivors]  # type: ignore[union-attr]
        m, s = len(self._weights), len(survivors)
        sigma, sigma_count = split_noise(SIGMA, m)
        for bit, _, ins in counts:  # the task: Andrew et al.'s split of the noise, this round's clip
            assert ins.config["dp_clip"] == clip and ins.config["dp_count_std"] == sigma_count
            assert math.isclose(float(ins.config["dp_noise_std"]), sigma * clip, rel_tol=1e-12)  # type: ignore[arg-type]
        # The bits are the survivors' own: their update's norm (rounding residual aside) against the clip.
        assert [bit for bit, _, _ in counts] == [c.inner.norm <= clip for c in survivors]  # type: ignore[attr-defined]
        noised = sum(value for _, value, _ in counts)  # sum of bits + the survivors' count noise
        unclipped = sum(bit for bit, _, _ in counts)
        # The unmasked share, read back from the ring, is that noised count over the survivors ...
        step = m / (ring_scale(bits=self.bits, clip=self.clip, clients=m) * COUNT_SCALE * self.clip)
        assert abs(out["dp_unclipped"] - noised / s) <= step
        # ... and the next clip is the server-side formula's on it (Privacy's next_clip).
        assert math.isclose(self.dp_clip, next_clip(clip, unclipped, s, noised - unclipped), rel_tol=1e-6)
        assert out["dp_clip"] == clip
        self.checked.append((server_round, clip, unclipped, s))
        return out


def _clients(n: int) -> list[Dropping]:
    """``n`` clients with update norms spread around the clip; each round one drops after sharing
    (fit) and one after its masked input (unmask), in turn."""
    norms = [0.1 + 0.15 * i for i in range(n)]  # 0.1 .. 1.45: the median near 0.8
    drops = {
        i: {r: FIT if (r + i) % n == 0 else UNMASK for r in range(1, ROUNDS + 1) if (r + i) % n in (0, 1)}
        for i in range(n)
    }
    return dropping([Sized(f"c{i}", norms[i], drops[i]) for i in range(n)], Counted)  # type: ignore[arg-type]


def test_the_adaptive_clip_follows_the_securely_summed_noised_count() -> None:
    clients = _clients(10)
    strategy = Checked(
        clients, bits=32, clip=SECAGG_CLIP, seed=3, dp_noise_multiplier=SIGMA, dp_clip=CLIP0, dp_adaptive=True
    )
    strategy.initialize(initial_state=_state())
    privacy = Privacy(noise_multiplier=SIGMA, clip=CLIP0, adaptive=True, distributed=True)
    engine = RoundEngine(
        strategy=strategy,
        fleet=InProcessFleet(clients),
        schedule=Schedule(
            rounds=ROUNDS,
            min_clients=1,
            round_timeout=timedelta(seconds=60),
            join_timeout=timedelta(seconds=10),
        ),
        rules=RoundRules(
            privacy=privacy,
        ),
    )
    engine.run()
    assert [r for r, *_ in strategy.checked] == list(range(1, ROUNDS + 1))
    assert [m.extra["secagg_survivors"] for m in engine.history] == [9.0] * ROUNDS  # one gone before fit
    clips = [clip for _, clip, _, _ in strategy.checked]
    assert clips[0] == CLIP0 and len(set(clips)) == ROUNDS  # each round's clip follows the last's count
    assert [m.extra["dp_clip"] for m in engine.history] == clips  # the round's clip, not the stage's
    assert all(m.extra["epsilon"] > 0 for m in engine.history) and privacy.accountant.rounds == ROUNDS
    # The clip is checkpointed with the strategy: a resume goes on from it.
    again = SecAgg(FedAvg(), clip=SECAGG_CLIP, dp_noise_multiplier=SIGMA, dp_clip=CLIP0, dp_adaptive=True)
    again.initialize(initial_state=_state())
    doc, tensors = encode_state(strategy.state_dict())  # as a checkpoint writes it (no pickle)
    again.load_state_dict(decode_state(json.loads(json.dumps(doc)), tensors))
    assert again.dp_clip == strategy.dp_clip != CLIP0


def test_the_count_share_has_std_over_sqrt_t_and_a_fixed_clip_sends_no_count() -> None:
    t, std = 4, 2.0
    ins = FitIns(round=2, config={"dp_count_std": std, "secagg_threshold": t})
    shares = torch.tensor([DistributedNoise().count(True, ins) - 1.0 for _ in range(4000)])
    assert abs(float(shares.std()) - std / math.sqrt(t)) < 0.05 * std / math.sqrt(t)
    # Without adaptive clipping the masked input has no count coordinate.
    clients = with_secagg([Sized(f"c{i}", 0.3, {}) for i in range(4)], noise_seed=1)  # type: ignore[arg-type]
    fixed = SecAgg(FedAvg(), clip=SECAGG_CLIP, dp_noise_multiplier=SIGMA, dp_clip=CLIP0)
    fixed.initialize(initial_state=_state())
    RoundEngine(
        strategy=fixed,
        fleet=InProcessFleet(clients),
        schedule=Schedule(
            rounds=1,
            min_clients=1,
            round_timeout=timedelta(seconds=60),
            join_timeout=timedelta(seconds=10),
        ),
    ).run()
    assert clients[0].last_input is not None and clients[0].last_input.numel() == 16
    assert fixed.dp_clip == CLIP0 and "secagg_dp_clip" not in fixed.state_dict()


def test_secagg_with_an_adaptive_clip_is_configured_end_to_end() -> None:
    config = load_config(
        overrides={
            "secagg": True,
            "dp_noise_multiplier": SIGMA,
            "dp_clip": "adaptive:0.25",
            "secagg_clip": 2.0,
        }
    )
    strategy = build_strategy(config, num_clients=6)
    assert isinstance(strategy, SecAgg) and strategy.dp_adaptive and strategy.dp_clip == 0.25
    clients = with_secagg([Sized(f"c{i}", 0.1 + 0.1 * i, {}) for i in range(6)], noise_seed=2)  # type: ignore[arg-type]
    strategy.initialize(initial_state=_state())
    engine = RoundEngine(
        strategy=strategy,
        fleet=InProcessFleet(clients),
        schedule=Schedule(
            rounds=2,
            min_clients=1,
            round_timeout=timedelta(seconds=60),
            join_timeout=timedelta(seconds=10),
        ),
    )
    engine.run()
    assert [m.extra["dp_clip"] for m in engine.history][0] == 0.25
    assert all(c.last_input is not None and c.last_input.numel() == 17 for c in clients)
    share = engine.history[0].extra["dp_unclipped"]
    assert math.isclose(engine.history[1].extra["dp_clip"], next_clip(0.25, share * 6, 6, 0.0), rel_tol=1e-12)
    # The count coordinate is in the ring's range: (bit + noise) * COUNT_SCALE * clip, unclamped.
    scale = ring_scale(bits=32, clip=2.0, clients=6)
    assert abs(float(dequantize(strategy.last_sum[-1:], scale=scale, bits=32)[0])) < 2.0
