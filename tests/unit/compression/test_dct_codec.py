"""``demo[:K]`` (DeMo's DCT-domain top-k): the transform is orthonormal and inverts, the error
is exactly ``sparseloco``'s on the DCT coefficients (a contraction), a signal sparse in the
DCT domain comes back whole, sizes match ``sparseloco`` at the same K, and the payload checks."""

from __future__ import annotations

import math

import pytest
import torch

from fedgrid.compression import DCTTopKCodec, ErrorFeedback, FeedbackRule, SparseLoCoCodec, get_codec
from fedgrid.compression.dct import SIDE, dct_matrix
from fedgrid.compression.sparseloco import CHUNK
from fedgrid.compression.spec import CodecSpec
from fedgrid.errors import InvalidUpdateError


def _roundtrip(spec: str, x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    codec = get_codec(spec)
    payload = bytes(codec.encode(x))
    assert len(payload) <= codec.max_payload_bytes(dtype=x.dtype, shape=tuple(x.shape))
    return payload, codec.decode(bytearray(payload), dtype=x.dtype, shape=tuple(x.shape))


@pytest.mark.parametrize("size", [1, 7, 64])
def test_dct_matrix_is_orthonormal_and_dct_ii(size: int) -> None:
    d = dct_matrix(size)
    torch.testing.assert_close(d @ d.T, torch.eye(size, dtype=torch.float64), atol=1e-12, rtol=0)
    t = torch.arange(size, dtype=torch.float64)
    f = 1 if size > 1 else 0
    torch.testing.assert_close(
        d[f], math.sqrt((2.0 if f else 1.0) / size) * torch.cos(math.pi * (t + 0.5) * f / size)
    )
    with pytest.raises(ValueError, match="at least 1 point"):
        dct_matrix(0)


@pytest.mark.parametrize("n", [CHUNK * 2, CHUNK + 200, 130])
def test_transform_keeps_energy_and_inverts(n: int) -> None:
    codec = DCTTopKCodec()
    x = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64).float()
    c = codec.transform(x)
    assert c.numel() == codec.padded(n) == n + (-(n % CHUNK)) % SIDE
    torch.testing.assert_close(c.double().square().sum(), x.double().square().sum(), rtol=1e-5, atol=0)
    torch.testing.assert_close(codec.transform(c, inverse=True)[:n], x, rtol=0, atol=1e-5)


def test_error_is_sparseloco_on_the_coefficients_over_20_draws() -> None:
    """decode(encode(x)) = DCT^-1(sparseloco round trip of DCT(x)): so the error is sparseloco's
    exact identity on the coefficients, at most ||x||^2 (without padding, equal)."""
    gen = torch.Generator().manual_seed(4)
    demo, sparse = DCTTopKCodec(64), SparseLoCoCodec(64)
    sparse.short_keeps_k = False  # demo's rule for a short chunk: K scaled by its length
    for i in range(20):
        n = 2 * CHUNK if i % 2 else CHUNK + 1000
        x = torch.randn(n, generator=gen, dtype=torch.float64)
        x = (x * torch.rand(n, generator=gen, dtype=torch.float64) ** 4 if i % 3 else x).float()
        _, y = _roundtrip("demo", x)
        c = demo.transform(x)
        c_hat = sparse.decode(sparse.encode(c), dtype=torch.float32, shape=tuple(c.shape))
        torch.testing.assert_close(y, demo.transform(c_hat, inverse=True)[:n], rtol=0, atol=1e-5)
        err, coef_err = (
            float((x.double() - y.double()).square().sum()),
            float((c - c_hat).double().square().sum()),
        )
        if n % CHUNK == 0:
            torch.testing.assert_close(err, coef_err, rtol=1e-4, atol=1e-6)
        assert err <= coef_err * (1 + 1e-4) + 1e-6 and coef_err < float(x.double().square().sum())


def test_a_signal_sparse_in_the_dct_domain_comes_back_whole() -> None:
    """32 equal-magnitude coefficients per chunk: the top 64 hold them (and 32 zeros), whose
    larger-half mean is their magnitude, so the round trip is exact up to float rounding;
    ``sparseloco`` on the same values (dense in time) loses most of them."""
    codec = DCTTopKCodec()
    gen = torch.Generator().manual_seed(5)
    c = torch.zeros(3 * CHUNK)
    for chunk in range(3):
        picks = torch.randperm(CHUNK, generator=gen)[:32] + chunk * CHUNK
        c[picks] = torch.where(torch.rand(32, generator=gen) < 0.5, -0.25, 0.25)
    x = codec.transform(c, inverse=True)
    _, y = _roundtrip("demo", x)
    energy = float(x.square().sum())
    assert float((x - y).square().sum()) < 1e-8 * energy
    _, y_sparse = _roundtrip("sparseloco", x)
    assert float((x - y_sparse).square().sum()) > 0.5 * energy


def test_sizes_match_sparseloco_and_small_tensors() -> None:
    x = torch.randn(16 * CHUNK, generator=torch.Generator().manual_seed(6))
    payload, y = _roundtrip("demo", x)
    # sparseloco's body: scales, 2-bit codes and Rice-coded offsets, under 8.5 bits an offset
    # here (12 at fixed width); the sizes differ by where the kept entries fall
    for size in (len(payload), len(get_codec("sparseloco").encode(x))):
        assert 1 + 6 + 16 * (64 * 2 / 8 + 8) + 1 < size <= 1 + 6 + 16 * (64 * 10.5 / 8 + 8)
    assert get_codec("demo").name == "demo" and get_codec("demo:8").name == "demo:8"
    # 100 elements: two rows of 64 after padding, round(64 * 128 / 4096) = 2 kept coefficients
    small = torch.randn(100, generator=torch.Generator().manual_seed(7))
    assert DCTTopKCodec().padded(100) == 128 and DCTTopKCodec().chunks(128) == [(0, 128, 2)]
    payload, y = _roundtrip("demo", small)
    # two gaps under 128: r <= 7, so at most 2 bytes of low bits and 1 of unary past r's byte
    assert 1 + 6 + 8 + 1 + 1 < len(payload) <= 1 + 6 + 8 + 1 + 1 + 3
    assert float((small - y).square().sum()) < float(small.square().sum())


def test_under_momentum_error_feedback_the_sum_sent_tracks_the_input() -> None:
    """Classic EF around demo: what was sent over 40 steps is the input minus the residual;
    the residual stays bounded (the codec is a contraction)."""
    gen = torch.Generator().manual_seed(8)
    ef = ErrorFeedback(CodecSpec.parse("demo"), FeedbackRule.parse("classic"))
    total_in, total_out, norms = torch.zeros(CHUNK), torch.zeros(CHUNK), []
    for _ in range(40):
        x = torch.randn(CHUNK, generator=gen) + 0.5
        sent = ef.encode("w", x)
        total_in += x
        total_out += sent.decoded
        norms.append(float(ef.residuals["w"].norm()))
    torch.testing.assert_close(total_out + ef.residuals["w"], total_in, rtol=0, atol=1e-3)
    assert max(norms[20:]) < 3 * max(norms[:20])


def test_payload_checks_name_the_problem() -> None:
    codec = get_codec("demo")
    x = torch.randn(CHUNK + 10, generator=torch.Generator().manual_seed(9))
    payload = bytearray(codec.encode(x))
    shape = (CHUNK + 10,)
    with pytest.raises(InvalidUpdateError, match=r"header kept per chunk is 65, the codec spec"):
        bad = bytearray(payload)
        bad[1:3] = (65).to_bytes(2, "little")
        codec.decode(bad, dtype=torch.float32, shape=shape)
    with pytest.raises(InvalidUpdateError, match="truncated"):
        codec.decode(payload[:-3], dtype=torch.float32, shape=shape)
    with pytest.raises(InvalidUpdateError, match="1 trailing bytes after the last unary code"):
        codec.decode(payload + b"\x00", dtype=torch.float32, shape=shape)
    with pytest.raises(InvalidUpdateError, match=r"over the \d+ a torch.float32 \[4106\] tensor allows"):
        codec.decode(payload + bytes(2000), dtype=torch.float32, shape=shape)
    with pytest.raises(ValueError, match="demo keeps 1..4096 coefficients per chunk, got 0"):
        DCTTopKCodec(0)


def test_scaled_demo_moves_as_far_along_x_as_x_and_runs_without_a_residual() -> None:
    """``demo:K:scaled``: the DCT is orthonormal, so scaling each chunk's coefficients to
    ``<c^, c> = ||c||^2`` gives ``<x^, x> = ||x||^2`` per chunk of ``x``; short tensors keep
    ``min(K, L)`` coefficients, as ``sparseloco`` does."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3 * CHUNK, generator=gen) * torch.rand(3 * CHUNK, generator=gen) ** 2
    _, y = _roundtrip("demo:64:scaled", x)
    for c in range(3):
        part, got = x[c * CHUNK : (c + 1) * CHUNK].double(), y[c * CHUNK : (c + 1) * CHUNK].double()
        torch.testing.assert_close(float(got @ part), float(part @ part), rtol=1e-4, atol=0.0)
    _, plain = _roundtrip("demo", x)
    assert float(plain.double() @ x.double()) < 0.5 * float(x.double() @ x.double())
    codec = get_codec("demo:64:scaled")
    assert (codec.name, codec.contractive, codec.auto_feedback) == ("demo:64:scaled", False, "none")
    assert codec.chunks(100) == [(0, 100, 64)] and get_codec("demo").chunks(128) == [(0, 128, 2)]
