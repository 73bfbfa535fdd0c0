"""``sparseloco:K:scaled``: sparseloco's wire format with each chunk's two magnitudes scaled by
``||x||^2 / ||x^||^2`` of the chunk, so ``<x^, x> = ||x||^2`` chunk by chunk."""

from __future__ import annotations

import pytest
import torch

from fedgrid.compression import get_codec, parse_codec_spec
from fedgrid.compression.feedback import ErrorFeedback, FeedbackRule
from fedgrid.compression.sparseloco import CHUNK
from fedgrid.compression.spec import CodecSpec
from fedgrid.config import load_config
from fedgrid.errors import ConfigError, InvalidUpdateError
from fedgrid.server.strategies import codec_strategy_defaults


def _decode(spec: str, x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    codec = get_codec(spec)
    payload = bytes(codec.encode(x))
    assert len(payload) <= codec.max_payload_bytes(dtype=x.dtype, shape=tuple(x.shape))
    return payload, codec.decode(bytearray(payload), dtype=x.dtype, shape=tuple(x.shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,k", [(3 * CHUNK + 1000, 150), (CHUNK, 64), (72, 150), (640, 64), (10, 3)])
def test_each_chunk_moves_as_far_along_x_as_x_and_keeps_sparselocos_entries(
    dtype: torch.dtype, n: int, k: int
) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + k), dtype=torch.float64).to(dtype)
    payload, y = _decode(f"sparseloco:{k}:scaled", x)
    plain_payload, plain = _decode(f"sparseloco:{k}", x)
    assert len(payload) == len(plain_payload)  # the same format: only the chunk magnitudes differ
    assert torch.equal(y != 0, plain != 0) and torch.equal(torch.sign(y), torch.sign(plain))
    x64, y64, p64 = x.double(), y.double(), plain.double()
    for start in range(0, n, CHUNK):
        part = slice(start, min(n, start + CHUNK))
        energy = float(x64[part] @ x64[part])
        assert float(y64[part] @ x64[part]) == pytest.approx(energy, rel=1e-5)
        # the plain codec's chunk times one factor, ||x||^2 / ||x^||^2, at least 1
        factor = energy / float(p64[part] @ p64[part])
        assert factor >= 1.0 and torch.allclose(y64[part], factor * p64[part], rtol=1e-5, atol=0)


def test_zeros_stay_zeros_and_fp16_does_not_overflow() -> None:
    _, y = _decode("sparseloco:64:scaled", torch.zeros(5000))
    assert torch.equal(y, torch.zeros(5000))
    x = torch.full((5000,), 1000.0, dtype=torch.float16)
    _, y = _decode("sparseloco:8:scaled", x)  # unscaled, the factor would be 512: 512000 is past fp16
    assert bool(torch.isfinite(y).all()) and float(y.float().abs().max()) <= 65504.0


def test_names_flags_and_strategy_defaults() -> None:
    codec = get_codec("sparseloco:150:scaled")
    assert codec.name == "sparseloco:150:scaled" and not codec.contractive and codec.auto_feedback == "none"
    assert get_codec("sparseloco:150:scaled+zstd").name == "sparseloco:150:scaled+zstd"
    assert (
        get_codec("sparseloco:150").contractive and get_codec("sparseloco").auto_feedback == "momentum:0.95"
    )
    # It is a FedAvg uplink: under DiLoCo it keeps DiLoCo's outer step (SparseLoCo's is for the plain codec).
    config = load_config(overrides={"strategy": "diloco", "codec": "sparseloco:150:scaled"})
    assert codec_strategy_defaults(config) == {}


@pytest.mark.parametrize(
    "spec,match",
    [
        ("sparseloco:150:scale", r"'sparseloco:K\[:scaled\]' ends in ':scaled' or nothing, got 'scale'"),
        ("sparseloco::scaled", r"needs an integer in 1\.\.4096, got ''"),
        ("sparseloco:", r"needs an integer in 1\.\.4096, got ''"),
        ("sparseloco:5000:scaled", r"needs an integer in 1\.\.4096, got '5000'"),
    ],
)
def test_bad_specs_name_the_problem(spec: str, match: str) -> None:
    with pytest.raises(InvalidUpdateError, match=match):
        get_codec(spec)
    with pytest.raises(ConfigError, match="codec"):
        parse_codec_spec(spec)


def test_it_runs_without_a_residual_and_refuses_one() -> None:
    feedback = ErrorFeedback(CodecSpec.parse("sparseloco:64:scaled"), FeedbackRule(kind="auto"))
    assert feedback.rule.kind == "none"
    for step in range(3):
        feedback.encode("w", torch.randn(5000, generator=torch.Generator().manual_seed(step)))
    assert dict(feedback.residuals) == {}
    with pytest.raises(ConfigError, match="not contractive"):
        ErrorFeedback(CodecSpec.parse("sparseloco:64:scaled"), FeedbackRule.parse("momentum:0.95"))
