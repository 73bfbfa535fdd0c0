"""Unit tests of the codecs: round trips within each stated bound, statistical properties, sizes, specs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedgrid.compression import (
    Codec,
    IdentityCodec,
    PowerSGDCodec,
    TopKCodec,
    available_codecs,
    get_codec,
    parse_codec_spec,
    register_codec,
    registry,
)
from fedgrid.compression.quantize import QSGD_BUCKET, _flips, hadamard
from fedgrid.errors import ConfigError, InvalidUpdateError

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
LOSSY = [
    "fp16",
    "bf16",
    "int8",
    "int8:64",
    "qsgd:1",
    "qsgd:7",
    "qsgd:127",
    "qsgd:300",
    "topk:0.1",
    "randk:0.25",
    "randk:0.25:unbiased",
    "powersgd:2",
    "sign",
    "sign:8",
    "int4",
    "int4:32",
    "fp4",
    "fp4:16",
    "sparseloco",
    "sparseloco:4",
    "demo",
    "demo:4",
]
ALL = ["none", "none+zstd", *LOSSY, "int8+zstd", "topk:0.1+zstd:1"]
#: Relative rounding of the final cast to the declared dtype (float64 goes through float32 inside).
OUT_EPS = {torch.float32: 2.0**-23, torch.float64: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
#: Absolute rounding of that cast below the normal range (half the subnormal spacing, doubled).
OUT_ABS = {
    torch.float32: 2.0**-149,
    torch.float64: 2.0**-149,
    torch.float16: 2.0**-24,
    torch.bfloat16: 2.0**-133,
}

shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)
kinds = st.sampled_from(["normal", "tiny", "large", "sparse", "zeros", "constant"])


def _make(shape: tuple[int, ...], dtype: torch.dtype, kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if kind == "tiny":
        x = x * 1e-6
    elif kind == "large":
        x = x * 1e3
    elif kind == "sparse":
        x = x * (torch.rand(shape, generator=gen, dtype=torch.float64) < 0.05)
    elif kind == "zeros":
        x = torch.zeros(shape, dtype=torch.float64)
    elif kind == "constant":
        x = torch.full(shape, -2.5, dtype=torch.float64)
    return x.to(dtype)


def _roundtrip(codec: Codec, x: torch.Tensor, seed: int = 0) -> tuple[bytes, torch.Tensor]:
    payload = bytes(codec.encode(x, generator=torch.Generator().manual_seed(seed)))
    shape = tuple(x.shape)
    assert len(payload) <= codec.max_payload_bytes(dtype=x.dtype, shape=shape)
    y = codec.decode(bytearray(payload), dtype=x.dtype, shape=shape)
    assert y.dtype == x.dtype and tuple(y.shape) == shape and y.device.type == "cpu"
    return payload, y


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.reshape(-1).double()
    return torch.nn.functional.pad(flat, (0, (-flat.numel()) % block)).reshape(-1, block)


def _elementwise_bound(spec: str, x: torch.Tensor) -> torch.Tensor | None:
    """The codec's stated per-element error bound for ``x`` (float64), or ``None`` if it has none."""
    base = spec.split("+")[0]
    a = x.double().reshape(-1).abs()
    n = a.numel()
    if base in ("none",):
        return torch.zeros_like(a)
    if base == "fp16":
        return a * 2.0**-11 + 2.0**-25
    if base == "bf16":
        return a * 2.0**-8 + 2.0**-126
    if base.startswith("int8"):
        block = int(base.split(":")[1]) if ":" in base else 256
        absmax = _blocks(x, block).abs().amax(dim=1)
        return (absmax / 254).repeat_interleave(block)[:n] + a * 2.0**-23
    if base.startswith("qsgd"):
        levels = int(base.split(":")[1])
        norms = torch.linalg.vector_norm(_blocks(x, QSGD_BUCKET), dim=1)
        return (norms / levels).repeat_interleave(QSGD_BUCKET)[:n] * (1 + 1e-5) + a * 2.0**-23
    if base.endswith(":unbiased"):  # each element is zeroed or kept times n/k
        k = get_codec(base).k_for(n)  # type: ignore[attr-defined]
        scale = n / k if k else 1.0
        return a * max(1.0, scale - 1.0) * (1 + 1e-2)
    if base.startswith(("topk", "randk")):
        return a  # each element is kept exactly or zeroed
    if base.startswith("int4"):
        block = int(base.split(":")[1]) if ":" in base else 256
        absmax = _blocks(x, block).abs().amax(dim=1)
        return (absmax / 14).repeat_interleave(block)[:n] * (1 + 1e-6) + a * 2.0**-23
    if base.startswith("fp4"):
        block = int(base.split(":")[1]) if ":" in base else 256
        absmax = (_blocks(x, block).abs().amax(dim=1) / 24).repeat_interleave(block)[:n]
        return torch.maximum(absmax, a / 4) * (1 + 1e-6) + a * 2.0**-23
    # powersgd, sign, sparseloco, demo: Frobenius-norm bounds, checked separately (test_outer_codecs.py)
    return None


@pytest.mark.parametrize("spec", ALL)
@settings(deadline=None, max_examples=25)
@given(shape=shapes, dtype=st.sampled_from(FLOATS), kind=kinds, seed=st.integers(0, 2**31 - 1))
def test_roundtrip_within_stated_bound(spec: str, shape, dtype, kind, seed) -> None:
    codec = get_codec(spec)
    x = _make(shape, dtype, kind, seed)
    payload, y = _roundtrip(codec, x, seed)
    err = (x.double() - y.double()).reshape(-1).abs()
    bound = _elementwise_bound(spec, x)
    if bound is not None:
        tol = bound + OUT_EPS[dtype] * (x.double().reshape(-1).abs() + bound) + OUT_ABS[dtype]
        assert bool((err <= tol).all()), f"max excess {float((err - tol).max())}"
    else:  # powersgd: the projection never grows the matrix
        assert float(err.norm()) <= float(x.double().norm()) * (1 + 1e-3) + 1e-12
    if codec.lossless:
        assert torch.equal(_bits(x), _bits(y))


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize(
    "x",
    [
        torch.arange(-5, 7, dtype=torch.int64).reshape(3, 4),
        torch.tensor([True, False, True]),
        torch.arange(200, dtype=torch.uint8),
        torch.randn(4, 5, dtype=torch.complex64),
        torch.arange(300, dtype=torch.int32),
    ],
    ids=["int64", "bool", "uint8", "complex64", "int32"],
)
def test_non_float_dtypes_take_the_lossless_path(spec: str, x: torch.Tensor) -> None:
    payload, y = _roundtrip(get_codec(spec), x)
    assert torch.equal(_bits(x), _bits(y))
    if "zstd" not in spec:
        assert payload == bytes(IdentityCodec().encode(x))


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), ()])
def test_empty_and_scalar_tensors(spec: str, shape: tuple[int, ...]) -> None:
    x = torch.full(shape, 1.5)
    payload, y = _roundtrip(get_codec(spec), x)
    if x.numel() == 0:
        assert len(payload) <= 1
    assert torch.allclose(y, x) or spec.startswith(("qsgd", "sign"))


def test_lossy_codecs_refuse_nan_and_inf() -> None:
    for spec in ("int8", "topk:0.1", "sign", "qsgd:4", "powersgd:1", "int4", "fp4", "sparseloco", "demo"):
        for bad in (math.nan, math.inf):
            x = torch.randn(64, 64)
            x[3, 5] = bad
            with pytest.raises(InvalidUpdateError, match="NaN or Inf"):
                get_codec(spec).encode(x)


def test_fp16_falls_back_to_raw_beyond_its_range() -> None:
    x = torch.tensor([1.0, 70000.0, -3.0])
    payload, y = _roundtrip(get_codec("fp16"), x)
    assert payload[0] == 1 and torch.equal(y, x)
    assert get_codec("fp16").max_payload_bytes(dtype=torch.float32, shape=(3,)) == 13


def test_bare_topk_and_randk_take_their_default_fractions() -> None:
    assert get_codec("topk").name == "topk:0.1" and get_codec("topk").contractive
    randk = get_codec("randk")
    assert randk.name == "randk:0.25:unbiased" and randk.unbiased and not randk.contractive
    assert get_codec("randk:0.25").contractive and not get_codec("randk:0.25").unbiased
    assert get_codec("randk:0.5:unbiased+zstd").unbiased and get_codec("randk:0.5:unbiased+zstd").stochastic


def test_unbiased_randk_is_unbiased_with_variance_n_over_k_minus_1_over_2000_seeded_draws() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(7))
    codec = get_codec("randk:0.1:unbiased")
    draws = torch.stack([_roundtrip(codec, x, seed)[1] for seed in range(2000)]).double()
    x64 = x.double()
    # Per element: x * 10 with probability 1/10, else 0: variance 9 x^2, standard error 3|x|/sqrt(2000).
    assert bool(((draws.mean(0) - x64).abs() <= 5 * 3 * x64.abs() / math.sqrt(2000) + 1e-6).all())
    mse = float(((draws - x64) ** 2).sum(1).mean() / (x64**2).sum())
    assert abs(mse - 9.0) < 0.3  # E||x^ - x||^2 = (n/k - 1) ||x||^2


def test_qsgd_is_unbiased_over_500_seeded_draws() -> None:
    levels = 4
    x = torch.randn(1000, generator=torch.Generator().manual_seed(7))
    codec = get_codec(f"qsgd:{levels}")
    draws = torch.stack([_roundtrip(codec, x, seed)[1] for seed in range(500)])
    step = (torch.linalg.vector_norm(_blocks(x, QSGD_BUCKET), dim=1) / levels).repeat_interleave(QSGD_BUCKET)[
        :1000
    ]
    # Each draw is one of two levels a step apart: standard error <= step / 2 / sqrt(500).
    assert bool(((draws.mean(0).double() - x.double()).abs() <= 5 * step / 2 / math.sqrt(500)).all())
    assert abs(float((draws.mean(0) - x).mean())) < 0.02
    assert len({bytes(codec.encode(x, generator=torch.Generator().manual_seed(s))) for s in (1, 1, 2)}) == 2


@pytest.mark.parametrize(
    "shape,true_rank,rank", [((64, 48), 2, 2), ((64, 48), 1, 4), ((16, 8, 3, 3), 3, 4), ((200, 30), 4, 4)]
)
def test_powersgd_exact_on_inputs_of_rank_at_most_its_rank(shape, true_rank, rank) -> None:
    gen = torch.Generator().manual_seed(3)
    rows, cols = shape[0], math.prod(shape[1:])
    m = (torch.randn(rows, true_rank, generator=gen) @ torch.randn(true_rank, cols, generator=gen)).reshape(
        shape
    )
    payload, y = _roundtrip(get_codec(f"powersgd:{rank}"), m)
    assert payload[0] == 0  # the coded form, not the raw fallback
    torch.testing.assert_close(y, m, rtol=1e-4, atol=1e-4 * float(m.abs().max()))
    assert len(payload) == 1 + 2 + 4 * rank * (rows + cols)


def test_powersgd_warm_start_converges_to_the_best_rank_r_error() -> None:
    gen = torch.Generator().manual_seed(5)
    u, _ = torch.linalg.qr(torch.randn(60, 60, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(40, 40, generator=gen))
    s = torch.tensor([10.0, 8.0, 6.0, 1.0] + [0.5] * 36)
    m = u[:, :40] @ torch.diag(s) @ v.T
    best = float(s[2:].norm())
    cold = PowerSGDCodec(2)
    warm = PowerSGDCodec(2)
    errors: list[float] = []
    for _ in range(12):
        payload = warm.encode(m, key="w")
        errors.append(float((m - warm.decode(payload, dtype=m.dtype, shape=(60, 40))).norm()))
    assert errors[-1] <= best * 1.02
    assert float((m - _roundtrip(cold, m)[1]).norm()) >= errors[-1]
    clone = PowerSGDCodec(2)
    clone.load_state_dict(warm.state_dict())
    assert bytes(clone.encode(m, key="w")) == bytes(warm.encode(m, key="w"))


def test_powersgd_small_tensors_and_high_rank_fall_back_to_lossless() -> None:
    codec = get_codec("powersgd:4")
    for x in (torch.randn(100), torch.randn(7, 7), torch.randn(8, 100)):
        payload, y = _roundtrip(codec, x)
        assert payload[0] == 1 and torch.equal(x, y)
        assert codec.max_payload_bytes(dtype=x.dtype, shape=tuple(x.shape)) == 1 + 4 * x.numel()


@settings(deadline=None, max_examples=40)
@given(
    n=st.integers(1, 3000),
    fraction=st.sampled_from([0.001, 0.01, 0.1, 0.3]),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(FLOATS),
)
def test_topk_keeps_exactly_the_k_largest_magnitudes(n: int, fraction: float, seed: int, dtype) -> None:
    x = _make((n,), dtype, "normal", seed)
    codec = TopKCodec(fraction)
    payload, y = _roundtrip(codec, x)
    k = codec.k_for(n)
    if payload[0] == 1:  # raw fallback: coded form would not be smaller
        assert torch.equal(_bits(x), _bits(y))
        return
    kept = y != 0
    assert int(kept.sum()) == k
    assert torch.equal(_bits(y[kept]), _bits(x[kept]))
    ranked = x.double().abs().sort(descending=True).values
    assert torch.equal(x[kept].double().abs().sort(descending=True).values, ranked[:k])


def test_randk_keeps_k_exact_values_and_is_reproducible() -> None:
    x = torch.randn(5000) + 10
    codec = get_codec("randk:0.02")
    p1, y = _roundtrip(codec, x, seed=11)
    p2, _ = _roundtrip(codec, x, seed=11)
    assert p1 == p2 and int((y != 0).sum()) == 100
    assert torch.equal(y[y != 0], x[y != 0])


def test_sign_is_the_scaled_sign_of_rotated_blocks() -> None:
    x = torch.randn(1024, dtype=torch.float64) * torch.rand(1024, dtype=torch.float64) ** 4  # heavy tails
    x[0] = 0.0
    payload, y = _roundtrip(get_codec("sign"), x)
    assert len(payload) == 1 + 4 + 4 * 4 + 1024 // 8
    rotated = hadamard(_blocks(x, 256).float() * _flips(256))
    back = hadamard(_blocks(y, 256).float() * _flips(256))  # the rotation undone: +-scale per block
    scale = rotated.abs().mean(dim=1, keepdim=True)
    torch.testing.assert_close(back.abs(), scale.expand_as(back), rtol=1e-5, atol=1e-7)
    assert bool(((back > 0) == (rotated >= 0)).all())
    # Whole blocks: ||x - x^||^2 = ||x||^2 - sum over blocks of ||r||_1^2 / 256, far under plain sign's.
    expected = x.norm() ** 2 - (rotated.double().abs().sum(dim=1) ** 2 / 256).sum()
    torch.testing.assert_close((x - y).norm() ** 2, expected, rtol=1e-4, atol=1e-8)
    plain = x.norm() ** 2 - x.abs().sum() ** 2 / x.numel()
    assert float(expected) < 0.75 * float(plain)


def test_measured_compression_ratios() -> None:
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    raw = x.numel() * 4
    ratios = {
        spec: raw / len(get_codec(spec).encode(x)) for spec in ("int8", "topk:0.01", "sign", "qsgd:7", "fp16")
    }
    assert ratios["int8"] >= 3.9
    assert ratios["topk:0.01"] >= 50
    assert ratios["sign"] >= 28.4 and ratios["qsgd:7"] >= 7.8 and ratios["fp16"] >= 1.99
    m = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    assert raw / len(get_codec("powersgd:4").encode(m)) >= 100


def test_zstd_stage_pays_or_stays_raw() -> None:
    ints = torch.zeros(10_000, dtype=torch.int64)
    codec = get_codec("none+zstd")
    payload, y = _roundtrip(codec, ints)
    assert len(payload) < 200 and torch.equal(y, ints)
    noise = torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    payload, y = _roundtrip(codec, noise)
    assert payload[0] == 0 and len(payload) == 1001 and torch.equal(y, noise)
    smooth = torch.linspace(0, 1, 50_000)
    assert len(codec.encode(smooth)) < 0.8 * len(
        get_codec("none").encode(smooth)
    )  # byte shuffle helps floats


# -- specs and the registry ------------------------------------------------------------------
@pytest.mark.parametrize("spec", ALL + ["int8:128+zstd:19", "powersgd:8", "topk:1e-3"])
def test_specs_parse_and_names_round_trip(spec: str) -> None:
    codec = get_codec(spec)
    assert get_codec(spec) is codec
    again = get_codec(codec.name)
    x = torch.randn(40, 30, generator=torch.Generator().manual_seed(2))
    assert bytes(again.encode(x, generator=torch.Generator().manual_seed(0))) == bytes(
        codec.encode(x, generator=torch.Generator().manual_seed(0))
    )
    fresh = parse_codec_spec(spec)
    assert fresh.name == codec.name and (fresh is not codec or spec == "none")


def test_none_is_unchanged() -> None:
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert bytes(IdentityCodec().encode(x)) == x.numpy().tobytes()
    assert get_codec("none").name == "none" and get_codec("none").lossless


@pytest.mark.parametrize(
    "spec,match",
    [
        ("foo", r"unknown codec 'foo' \(known: none, fp16, bf16, int8\[:BLOCK\], qsgd\[:LEVELS\]"),
        ("zstd", r"unknown codec 'zstd' \(known: none"),
        ("", r"empty codec spec"),
        ("randk:0.1:biased", r"'randk:FRACTION\[:unbiased\]' ends in ':unbiased' or nothing, got 'biased'"),
        ("randk:x:unbiased", r"'randk:FRACTION\[:unbiased\]' needs a fraction in \(0, 1\], got 'x'"),
        ("topk:0", r"needs a fraction"),
        ("topk:1.5", r"needs a fraction"),
        ("topk:nan", r"needs a fraction"),
        ("randk:abc", r"needs a fraction"),
        ("qsgd:0", r"'qsgd\[:LEVELS\]' needs an integer in 1..32767"),
        ("qsgd:40000", r"needs an integer"),
        ("powersgd:-1", r"needs an integer"),
        ("int8:3", r"needs an integer in 8..65536"),
        ("fp16:2", r"codec 'fp16' takes no parameter"),
        ("none:1", r"codec 'none' takes no parameter"),
        ("int8+gzip", r"unknown stage 'gzip'"),
        ("int8+zstd+zstd", r"at most one"),
        ("int8+zstd:99", r"needs an integer in 1..22"),
        ("topk:" + "1" * 80, r"over the 64 allowed"),
        ("int4:3", r"'int4\[:BLOCK\]' needs an integer in 8..65536, got '3'"),
        ("fp4:x", r"'fp4\[:BLOCK\]' needs an integer in 8..65536, got 'x'"),
        ("sparseloco:5000", r"'sparseloco\[:K\[:scaled\]\]' needs an integer in 1..4096, got '5000'"),
        ("sign:100", r"codec spec 'sign:100': sign block size must be a power of two in 8..65536, got 100"),
        (
            "fp8",
            r"unknown codec 'fp8' \(known: .*int4\[:BLOCK\], fp4\[:BLOCK\], sparseloco\[:K\[:scaled\]\], demo\[:K\[:scaled\]\]",
        ),
        ("demo:0", r"'demo\[:K\[:scaled\]\]' needs an integer in 1..4096, got '0'"),
        ("demo:1.5", r"'demo\[:K\[:scaled\]\]' needs an integer in 1..4096, got '1.5'"),
        ("demo:64:sharp", r"'demo:K\[:scaled\]' ends in ':scaled' or nothing, got 'sharp'"),
    ],
)
def test_bad_specs_are_rejected(spec: str, match: str) -> None:
    with pytest.raises(InvalidUpdateError, match=match):
        get_codec(spec)
    with pytest.raises(ConfigError, match=r"config key 'downlink_codec': .*" + match) as info:
        parse_codec_spec(spec, key="downlink_codec")
    assert info.value.key == "downlink_codec"


def test_available_codecs_and_register_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    monkeypatch.setattr(registry, "_CACHE", {})
    assert {"none", "fp16", "bf16", "int8", "qsgd", "topk", "randk", "powersgd", "sign"} <= set(
        available_codecs()
    )

    class Negate(IdentityCodec):
        name = "negate_test"

    register_codec(Negate())
    assert isinstance(get_codec("negate_test"), Negate)
    assert isinstance(get_codec("negate_test+zstd").inner, Negate)  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        register_codec(type("Bad", (IdentityCodec,), {"name": "a+b"})())


def test_bare_qsgd_and_powersgd_take_their_defaults_like_every_other_codec():
    qsgd, powersgd = get_codec("qsgd"), get_codec("powersgd")
    assert (qsgd.levels, qsgd.bits) == (127, 8)  # one byte a coordinate
    assert powersgd.rank == 4
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    for bare, named in (("qsgd", "qsgd:127"), ("powersgd", "powersgd:4")):
        assert get_codec(bare).name == named
        one, two = (get_codec(s).encode(x, generator=torch.Generator().manual_seed(1)) for s in (bare, named))
        assert one == two
