"""``topk:FRACTION:scaled``: top-k whose kept values the receiver scales by ``||x||^2 / ||topk(x)||^2``."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from fedgrid.client.uplink import UplinkEncoder
from fedgrid.compression import TopKCodec, get_codec, parse_codec_spec
from fedgrid.compression.feedback import ErrorFeedback, FeedbackRule
from fedgrid.compression.spec import CodecSpec
from fedgrid.errors import ConfigError, InvalidUpdateError

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _roundtrip(spec: str, x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    codec = get_codec(spec)
    payload = bytes(codec.encode(x))
    assert len(payload) <= codec.max_payload_bytes(dtype=x.dtype, shape=tuple(x.shape))
    return payload, codec.decode(bytearray(payload), dtype=x.dtype, shape=tuple(x.shape))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n,fraction", [(5000, 0.013), (1152, 0.013), (72, 0.013), (40, 0.1), (300, 0.5)])
def test_scaled_topk_keeps_topk_support_and_makes_the_inner_product_the_energy(
    dtype: torch.dtype, n: int, fraction: float
) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64).to(dtype)
    spec = f"topk:{fraction!r}:scaled"
    payload, y = _roundtrip(spec, x)
    plain = get_codec(f"topk:{fraction!r}").decode(
        get_codec(f"topk:{fraction!r}").encode(x), dtype=dtype, shape=(n,)
    )
    assert payload[0] == 0 and len(payload) == len(get_codec(f"topk:{fraction!r}").encode(x)) + 4
    assert torch.equal(y != 0, plain != 0)  # the same k entries
    x64, t64 = x.double(), plain.double()
    scale = struct.unpack("<f", payload[9:13])[0]
    assert scale == pytest.approx(float(x64 @ x64 / (t64 @ t64)), rel=1e-6)
    # decoded = scale * topk(x), to the dtype's rounding; so <decoded, x> = ||x||^2
    eps = {torch.float32: 2e-7, torch.float64: 2e-7, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert torch.allclose(y.double(), scale * t64, rtol=eps, atol=0)
    assert float(y.double() @ x64) == pytest.approx(float(x64 @ x64), rel=eps * 4)
    # and its error is exactly what the scale adds: ||x - s t||^2 = ||x||^2 (s - 1) for top-k's t
    err = float((y.double() - x64).square().sum())
    assert err == pytest.approx(float(x64 @ x64) * (scale - 1.0), rel=eps * 8, abs=1e-9)


def test_scaled_topk_on_zeros_and_huge_values_stays_finite() -> None:
    zeros = torch.zeros(1000)
    payload, y = _roundtrip("topk:0.01:scaled", zeros)
    assert struct.unpack("<f", payload[9:13])[0] == 1.0 and torch.equal(y, zeros)
    x = torch.full((1000,), 60000.0, dtype=torch.float16)
    x[:10] = 65000.0
    _, y = _roundtrip("topk:0.01:scaled", x)  # the scale is capped below fp16's overflow
    assert bool(torch.isfinite(y).all()) and float(y.float().max()) <= 65504.0


def test_scaled_topk_spec_names_and_flags() -> None:
    codec = get_codec("topk:0.013:scaled")
    assert codec.name == "topk:0.013:scaled" and isinstance(codec, TopKCodec)
    assert not codec.contractive and not codec.unbiased and codec.auto_feedback == "none"
    assert get_codec("topk:0.013:scaled+zstd").name == "topk:0.013:scaled+zstd"
    assert get_codec("topk").name == "topk:0.1" and get_codec("topk:0.013").contractive


@pytest.mark.parametrize(
    "spec,match",
    [
        ("topk:0.01:scale", r"'topk:FRACTION\[:scaled\]' ends in ':scaled' or nothing, got 'scale'"),
        ("topk:0.01:scaled:x", r"ends in ':scaled' or nothing, got 'scaled:x'"),
        ("topk:2:scaled", r"'topk:FRACTION\[:scaled\]' needs a fraction in \(0, 1\], got '2'"),
        ("topk::scaled", r"needs a fraction in \(0, 1\], got ''"),
    ],
)
def test_bad_scaled_topk_specs_name_the_problem(spec: str, match: str) -> None:
    with pytest.raises(InvalidUpdateError, match=match):
        get_codec(spec)
    with pytest.raises(ConfigError, match="codec"):
        parse_codec_spec(spec)


@pytest.mark.parametrize("scale", [0.5, math.inf, math.nan, -2.0])
def test_a_scale_below_one_or_not_finite_is_refused(scale: float) -> None:
    x = torch.randn(2000, generator=torch.Generator().manual_seed(3))
    codec = get_codec("topk:0.01:scaled")
    payload = bytearray(codec.encode(x))
    payload[9:13] = struct.pack("<f", scale)
    with pytest.raises(InvalidUpdateError, match="scale must be finite and at least 1"):
        codec.decode(payload, dtype=torch.float32, shape=(2000,))


def test_scaled_topk_runs_without_a_residual_and_refuses_one() -> None:
    feedback = ErrorFeedback(CodecSpec.parse("topk:0.05:scaled"), FeedbackRule(kind="auto"))
    assert feedback.rule.kind == "none"
    for step in range(3):
        feedback.encode("w", torch.randn(500, generator=torch.Generator().manual_seed(step)))
    assert dict(feedback.residuals) == {}
    with pytest.raises(ConfigError, match="not contractive"):
        ErrorFeedback(CodecSpec.parse("topk:0.05:scaled"), FeedbackRule.parse("momentum:0.5"))


def test_the_uplink_sends_the_scaled_difference_and_keeps_no_residual() -> None:
    g = {"w": torch.zeros(4000), "b": torch.ones(8)}
    new = {"w": torch.randn(4000, generator=torch.Generator().manual_seed(1)), "b": torch.ones(8) * 3}
    uplink = UplinkEncoder(CodecSpec.parse("topk:0.01:scaled")).begin(1, {})
    encoded, is_delta = uplink.encode(global_state=g, new_state=new)
    codec = get_codec("topk:0.01:scaled")
    assert is_delta and uplink.feedback is not None and dict(uplink.feedback.residuals) == {}
    for (name, _, payload), t in zip(encoded.payloads(), new.values()):
        delta = t - g[name]
        assert payload == bytes(codec.encode(delta))
        y = codec.decode(payload, dtype=delta.dtype, shape=tuple(delta.shape)).double()
        assert float(y @ delta.double()) == pytest.approx(float(delta.double().square().sum()), rel=1e-6)
