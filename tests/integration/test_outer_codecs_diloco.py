"""The outer-gradient codecs (``int4``, ``fp4``, ``sparseloco``, ``demo``) on DiLoCo's uplink: whole models,
streaming fragments, overlapped syncs; each sends its stated share of the bytes and trains."""

from __future__ import annotations

import pytest

from fedgrid.config import load_config
from fedgrid.simulation.run import run_simulation

from harness import REFERENCE

BASE = {"rounds": 4, "clients": 2, "seed": 3, "inner_steps": 6, "inner_lr": 0.01, **REFERENCE}
#: codec -> the least payload ratio (float32 bytes / payload) on the digits MLP's pseudo-gradients
#: (``sparseloco``: its small tensors, a 10 x 64 layer and biases, keep min(64, L) entries each)
CODECS = {"int4": 7.0, "fp4": 7.0, "sparseloco": 20.0, "demo": 25.0}


def _run(tmp_path, **overrides):
    config = load_config(overrides={**BASE, "out": str(tmp_path / "run"), **overrides})
    return run_simulation(config)[1]


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_overlapped_streaming_fragments_through_each_outer_codec(tmp_path, codec: str) -> None:
    streaming = {"strategy": "streaming-diloco", "num_fragments": 2, "sync_delay_steps": 2, "codec": codec}
    history = _run(tmp_path, **streaming, error_feedback="momentum:0.9")
    whole = _run(tmp_path, strategy="diloco", codec=codec)
    plain = _run(tmp_path, **{**streaming, "codec": "none"})
    assert [m.clients_ok for m in history] == [2] * 4 and [m.clients_ok for m in whole] == [2] * 4
    for m in history + whole:
        assert m.extra["uplink_ratio"] >= CODECS[codec], (codec, m.round, m.extra["uplink_ratio"])
    # A fragment is about half the model: its uploads are about half of a whole model's, coded alike.
    up = sum(m.bytes_up for m in history) / sum(m.bytes_up for m in whole)
    assert 0.3 < up < 0.8, up
    assert sum(m.bytes_up for m in plain) > CODECS[codec] * 0.8 * sum(m.bytes_up for m in history)
    assert whole[-1].loss < whole[0].loss - 0.1  # DiLoCo trains through it
    if codec not in (
        "sparseloco",
        "demo",
    ):  # 4 bits with error feedback: the uncompressed run's curve, nearly
        assert abs(history[-1].loss - plain[-1].loss) < 0.1, (history[-1].loss, plain[-1].loss)
