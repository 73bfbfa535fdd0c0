"""SecAgg+ composed with QSGD (``--codec qsgd:LEVELS --secagg``): the clients' QSGD levels,
over the public range ``secagg_clip`` in place of QSGD's per-client norm, are masked in the ring
of QSGD's code width; the unmasked sum is the survivors' plaintext levels bit for bit, with
clients dropping at every step; a masked upload costs no more than a plain QSGD one; the
rounding error stays on the client (its error feedback)."""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta

import pytest
import torch
from test_secagg import PHASES, Checked, Step, _federation, _state

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.secagg import ADVERTISE, SHARE, UNMASK, SecAgg
from fedgrid.aggregation.secagg_math import dequantize, ring_add
from fedgrid.client.secagg import with_secagg
from fedgrid.compression.spec import CodecSpec
from fedgrid.config import load_config
from fedgrid.config_secagg import secagg_ring
from fedgrid.fleet.codec_policy import CodecPolicy
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import Schedule
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.types import FitIns, ModelState


def _schedule(rounds: int) -> Schedule:
    return Schedule(
        rounds=rounds, min_clients=1, round_timeout=timedelta(seconds=60), join_timeout=timedelta(seconds=10)
    )


CLIP = 0.5


def _engine(strategy, clients, codec: str, rounds: int = 1) -> RoundEngine:  # type: ignore[no-untyped-def]
    fleet = InProcessFleet(clients, codec_policy=CodecPolicy(default=CodecSpec.parse(codec)))
    return RoundEngine(strategy=strategy, fleet=fleet, schedule=_schedule(rounds))


def _signed(q: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.where(q >= 1 << (bits - 1), q - (1 << bits), q)


@pytest.mark.parametrize("codec", ["qsgd:127", "qsgd:40", "qsgd:1000"])
def test_masked_qsgd_levels_sum_exactly_with_dropouts_at_every_step(codec: str) -> None:
    bits, levels = secagg_ring(CodecSpec.parse(codec))
    rounds, n = 4, 12
    clients = _federation(n, rounds, rate=0.2, seed=5)
    strategy = Checked(clients, bits=bits, levels=levels, clip=CLIP, seed=2)
    strategy.initialize(initial_state=_state())
    engine = _engine(strategy, clients, codec, rounds)
    engine.run()
    assert strategy.exact == list(range(1, rounds + 1))  # Checked: bit for bit, every round
    assert {p for c in clients for p in c.inner.drop.values()} == set(PHASES)  # type: ignore[attr-defined]
    scale = strategy._scale(n)  # noqa: SLF001
    assert scale == min(levels, (1 << (bits - 1)) - 1 - n) / CLIP
    # Each input of the last round: its weight's share of the levels, and one rounding step.
    shared = [c for c in clients if c.inner.drop.get(rounds) not in (ADVERTISE, SHARE)]  # type: ignore[attr-defined]
    for c in clients:
        if c.inner.drop.get(rounds) is None:  # type: ignore[attr-defined]
            assert c.last_input is not None
            weight = c.num_examples / sum(x.num_examples for x in shared)
            assert int(_signed(c.last_input, bits).abs().max()) <= weight * scale * CLIP + 1
    # The mean's levels: the last round's sum, read back, is at most `levels` steps of clip / levels.
    total = dequantize(strategy.last_sum, scale=scale, bits=bits)
    assert float(total.abs().max()) <= CLIP + n / scale


def _wide() -> ModelState:
    return OrderedDict(w=torch.zeros(64, 64), b=torch.zeros(64), steps=torch.zeros((), dtype=torch.int64))


@pytest.mark.parametrize("codec", ["qsgd:127", "qsgd:1000"])
def test_a_masked_qsgd_upload_costs_no_more_than_a_plain_one(codec: str) -> None:
    n = 6
    length = 64 * 64 + 64
    bits, levels = secagg_ring(CodecSpec.parse(codec))
    plain = FedAvg()
    plain.initialize(initial_state=_wide())
    plain_engine = _engine(plain, [Step(f"c{i}", 1 + i, {}) for i in range(n)], codec)
    plain_engine.run()
    clients = with_secagg([Step(f"c{i}", 1 + i, {}) for i in range(n)])  # type: ignore[arg-type]
    masked = SecAgg(FedAvg(), bits=bits, levels=levels, clip=CLIP)
    masked.initialize(initial_state=_wide())
    engine = _engine(masked, clients, codec)
    engine.run()
    (m,) = engine.history
    fit_up = m.bytes_up - sum(m.extra[f"{p}_bytes_up"] for p in (ADVERTISE, SHARE, UNMASK))
    plain_up = plain_engine.history[0].bytes_up
    assert n * length * bits // 8 <= fit_up <= plain_up  # the ring's bytes, no more than QSGD's
    assert plain_up - fit_up >= n * 4 * (length // 512)  # QSGD's norms in the clear, not sent masked
    # The rounding error stays on each client, for its next round (error feedback).
    for c in clients:
        assert c.residual is not None and c.residual.shape == (length,) and bool(c.residual.any())
    # And the model moved by the mean, within the levels' rounding.
    want = sum(c.inner.fit(_wide(), FitIns(round=1)).state["w"] * c.num_examples for c in clients) / sum(
        c.num_examples for c in clients
    )
    step = 1 / masked._scale(n)  # noqa: SLF001
    assert float((masked.global_state["w"] - want).abs().max()) <= n * step


def test_a_simulation_runs_secagg_over_qsgd() -> None:
    from fedgrid.server.strategies import build_strategy

    config = load_config(overrides={"secagg": True, "codec": "qsgd:127", "secagg_clip": CLIP})
    strategy = build_strategy(config, num_clients=8)
    assert isinstance(strategy, SecAgg) and (strategy.bits, strategy.levels) == (8, 127)
    clients = with_secagg([Step(f"c{i}", 1, {}) for i in range(8)])  # type: ignore[arg-type]
    strategy.initialize(initial_state=_state())
    engine = _engine(strategy, clients, config.codec)
    engine.run()
    assert engine.history[0].extra["secagg_survivors"] == 8.0
    total = torch.zeros(16, dtype=torch.int64)
    for c in clients:
        total = ring_add(total, c.last_input, bits=8)  # type: ignore[arg-type]
    assert torch.equal(strategy.last_sum, total)
