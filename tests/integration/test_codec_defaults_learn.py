"""Issue 29: every uplink codec learns digits at its defaults, within 0.05 of uncompressed.

``fedgrid simulate --rounds 5 --seed 5 --codec X`` with nothing else set (the issue's
measure; here on one thread, as ``test_defaults_learn`` runs, for the same reason): FedAvg,
10 clients, every one each round. ``X`` is bare: ``topk`` is ``topk:0.1`` under ``auto``
error feedback's ``momentum:0.5``, ``randk`` is ``randk:0.25:unbiased`` under no feedback.
Before (classic EF, ``randk:0.1`` unscaled): ``topk:0.1`` 0.788 and ``randk:0.1`` 0.407,
against ``none``'s 0.841. Five digits rounds are noisy (docs/links.rst gives other seeds), so
this pins the issue's seed; the unbiased ``randk`` also draws, from the task's seed.
"""

from __future__ import annotations

import pytest

from fedgrid.config import load_config
from fedgrid.simulation.run import run_simulation

# Observed after round 5 on one thread, seed 5 (the same as on two): none 0.841, topk 0.819,
# randk 0.805, sign 0.819, sparseloco (sent as sparseloco:64:scaled) 0.811, qsgd:4 (unbiased,
# without feedback) 0.808, demo (sent as demo:320:scaled) 0.833; topk under classic EF 0.788, plain
# sparseloco under momentum:0.95 0.747, demo:64:scaled (DeMo's K) 0.632.


def _accuracy(codec: str, error_feedback: str = "auto") -> float:
    config = load_config(
        overrides={
            "rounds": 5,
            "seed": 5,
            "threads": 1,
            "progress": False,
            "codec": codec,
            "error_feedback": error_feedback,
        }
    )
    _, history = run_simulation(config)
    assert len(history) == 5 and all(m.clients_ok == 10 for m in history)
    return float(history[-1].accuracy or 0.0)


@pytest.fixture(scope="module")
def uncompressed() -> float:
    return _accuracy("none")


@pytest.mark.parametrize("codec", ["topk", "randk", "sign", "sparseloco", "qsgd:4", "demo"])
def test_a_bare_codec_learns_within_0_05_of_uncompressed(codec: str, uncompressed: float) -> None:
    accuracy = _accuracy(codec)
    assert accuracy >= uncompressed - 0.05, f"{codec}: {accuracy:.4f} against none's {uncompressed:.4f}"


def test_classic_feedback_on_topk_is_what_fell_short(uncompressed: float) -> None:
    """The rule, not the fraction: ``topk:0.1`` under classic EF stays more than 0.05 behind."""
    assert _accuracy("topk", "classic") < uncompressed - 0.05


def test_plain_sparseloco_under_its_diloco_feedback_is_what_fell_short(uncompressed: float) -> None:
    """Under FedAvg ``sparseloco`` goes as ``sparseloco:64:scaled``; the plain form with
    SparseLoCo's ``momentum:0.95`` residual (what a named rule keeps) stays more than 0.05 behind."""
    assert _accuracy("sparseloco", "momentum:0.95") < uncompressed - 0.05


def test_demo_at_demos_own_k_is_what_fell_short(uncompressed: float) -> None:
    """A bare ``demo`` keeps 320 coefficients per chunk under FedAvg; at DeMo's 64 the DCT of an
    MLP's weights keeps too little of the update and ends more than 0.05 behind."""
    assert _accuracy("demo:64") < uncompressed - 0.05
