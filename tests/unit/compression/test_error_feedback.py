"""Unit tests of error feedback: the client's residual memory and the server's downlink shadow."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch

from fedgrid.compression import (
    DownlinkUpdate,
    ErrorFeedback,
    PowerSGDCodec,
    ShadowModel,
    apply_delta,
    apply_downlink,
    get_codec,
)
from fedgrid.compression.spec import CodecSpec
from fedgrid.errors import ConfigError, InvalidUpdateError

LOSSY = ["topk:0.05", "randk:0.1", "sign", "int8", "qsgd:32", "powersgd:2", "fp16", "bf16", "int8+zstd"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same_bits(a: dict[str, torch.Tensor] | OrderedDict[str, torch.Tensor], b) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])) for k in a
    )


def _model(seed: int = 0) -> OrderedDict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return OrderedDict(
        [
            ("conv.weight", torch.randn(16, 4, 3, 3, generator=gen)),
            ("fc.weight", torch.randn(32, 24, generator=gen)),
            ("fc.bias", torch.randn(32, generator=gen)),
            ("emb", torch.randn(40, 20, generator=gen).to(torch.bfloat16)),
            ("bn.num_batches_tracked", torch.tensor(7)),
        ]
    )


def _step(
    state: OrderedDict[str, torch.Tensor], seed: int, scale: float = 0.1
) -> OrderedDict[str, torch.Tensor]:
    """The next global model: a random step on every float tensor, +1 on the counter."""
    gen = torch.Generator().manual_seed(1000 + seed)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for k, v in state.items():
        if v.dtype.is_floating_point:
            out[k] = (v.float() + scale * torch.randn(v.shape, generator=gen)).to(v.dtype)
        else:
            out[k] = v + 1
    return out


# -- uplink --------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", LOSSY)
def test_transmitted_sum_equals_input_sum_minus_residual(spec: str) -> None:
    ef = ErrorFeedback(CodecSpec.parse(spec))
    gen = torch.Generator().manual_seed(1)
    inputs = {"w": torch.zeros(32, 24, dtype=torch.float64), "b": torch.zeros(32, dtype=torch.float64)}
    sent = {k: torch.zeros_like(v) for k, v in inputs.items()}
    max_norm = {k: 0.0 for k in inputs}
    for t in range(30):
        for name, shape in (("w", (32, 24)), ("b", (32,))):
            x = torch.randn(shape, generator=gen) * (1 + t % 3)
            out = ef.encode(name, x, generator=torch.Generator().manual_seed(t))
            assert out.decoded.dtype == x.dtype and torch.equal(
                out.decoded, get_codec(ef.codec.name).decode(out.payload, dtype=x.dtype, shape=shape)
            )
            inputs[name] += x.double()
            sent[name] += out.decoded.double()
            max_norm[name] = max(max_norm[name], float(x.norm()))
    for name in inputs:
        residual = ef.residuals[name].double()
        torch.testing.assert_close(sent[name], inputs[name] - residual, rtol=1e-5, atol=1e-4)
        assert float(residual.norm()) <= 10 * max_norm[name]


def test_topk_residual_stays_within_the_contraction_bound() -> None:
    ef = ErrorFeedback(CodecSpec.parse("topk:0.1"))
    gen = torch.Generator().manual_seed(2)
    delta = 0.1  # topk keeps 10%: ||x - C(x)||^2 <= (1 - delta) ||x||^2
    bound = math.sqrt(1 - delta) / (1 - math.sqrt(1 - delta))
    norms = []
    for _ in range(200):
        x = torch.randn(500, generator=gen)
        norms.append(float(x.norm()))
        ef.encode("w", x)
        assert float(ef.residuals["w"].norm()) <= bound * max(norms) * (1 + 1e-5)


def test_bf16_tensors_keep_a_float32_residual() -> None:
    ef = ErrorFeedback(CodecSpec.parse("int8"))
    x = torch.randn(300).to(torch.bfloat16)
    total_in, total_sent = torch.zeros(300, dtype=torch.float64), torch.zeros(300, dtype=torch.float64)
    for _ in range(20):
        out = ef.encode("w", x)
        assert out.decoded.dtype == torch.bfloat16
        total_in += x.double()
        total_sent += out.decoded.double()
    residual = ef.residuals["w"]
    assert residual.dtype == torch.float32
    torch.testing.assert_close(total_sent, total_in - residual.double(), rtol=0, atol=1e-4)


def test_lossless_paths_keep_no_residual() -> None:
    ef = ErrorFeedback(CodecSpec.parse("topk:0.01"))
    counter = torch.tensor([3, 4], dtype=torch.int64)
    out = ef.encode("n", counter)
    assert torch.equal(out.decoded, counter) and "n" not in ef.residuals
    exact = ErrorFeedback(CodecSpec.parse("none+zstd"))
    x = torch.randn(100)
    assert torch.equal(exact.encode("w", x).decoded, x) and not exact.residuals


def test_state_dict_resumes_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(48, 40, generator=gen) for _ in range(8)]
    uninterrupted = ErrorFeedback(CodecSpec.parse("powersgd:2"))
    first = [uninterrupted.encode("w", x).payload for x in xs]
    before = ErrorFeedback(CodecSpec.parse("powersgd:2"))
    for x in xs[:4]:
        before.encode("w", x)
    saved = before.state_dict()
    assert (
        saved["codec"] == "powersgd:2" and set(saved["residuals"]) == {"w"} and saved["codec_state"]["warm_q"]
    )
    resumed = ErrorFeedback(CodecSpec.parse("powersgd:2"))
    resumed.load_state_dict(saved)
    assert [resumed.encode("w", x).payload for x in xs[4:]] == first[4:]
    with pytest.raises(ValueError, match=r"state is for codec 'powersgd:2', this one uses 'int8'"):
        ErrorFeedback(CodecSpec.parse("int8")).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"tensor 'w' is \[3\], its residual \[48, 40\]"):
        resumed.encode("w", torch.zeros(3))
    resumed.reset()
    assert not resumed.residuals


def test_error_feedback_takes_a_codec_instance_or_a_spec() -> None:
    own = PowerSGDCodec(1)
    assert ErrorFeedback(own).codec is own
    assert (
        ErrorFeedback(CodecSpec.parse("powersgd:1")).codec
        is not ErrorFeedback(CodecSpec.parse("powersgd:1")).codec
    )  # per-client warm start
    with pytest.raises(ConfigError, match=r"config key 'codec': unknown codec 'foo'"):
        ErrorFeedback(CodecSpec.parse("foo"))
    with pytest.raises(ConfigError, match=r"config key 'codec': codec 'qsgd:4\+zstd' is not contractive"):
        ErrorFeedback(CodecSpec.parse("qsgd:4+zstd"))
    assert ErrorFeedback(CodecSpec.parse("qsgd:23")).codec.contractive


def test_qsgd_with_few_levels_is_not_contractive() -> None:
    """Why error feedback refuses it: the residual of qsgd:4 grows round after round."""
    codec = get_codec("qsgd:4")
    x = torch.randn(2048, generator=torch.Generator().manual_seed(0))
    errors = [
        float(
            (
                codec.decode(
                    codec.encode(x, generator=torch.Generator().manual_seed(s)), dtype=x.dtype, shape=(2048,)
                )
                - x
            ).norm()
        )
        for s in range(20)
    ]
    assert sum(errors) / len(errors) > float(x.norm())


# -- downlink ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["topk:0.05", "int8", "powersgd:2+zstd", "qsgd:64", "sign"])
def test_clients_hold_the_shadow_bit_for_bit(spec: str) -> None:
    initial = _model()
    server = ShadowModel(initial, codec=CodecSpec.parse(spec))
    clients = [OrderedDict((k, v.clone()) for k, v in initial.items()) for _ in range(3)]
    versions = [0, 0, 0]
    global_state = initial
    for r in range(12):
        global_state = _step(global_state, r)
        before = OrderedDict((k, v.clone()) for k, v in server.shadow.items())
        update, shadow = server.sync(global_state, generator=torch.Generator().manual_seed(r))
        assert update.base_version == r and update.version == r + 1 == server.version
        for i in range(3):
            clients[i] = apply_downlink(clients[i], update, held_version=versions[i])
            versions[i] = update.version
            assert _same_bits(clients[i], shadow)
        # The shadow moved by exactly what was sent; the rest is the carried residual.
        gap = server.gap(global_state)
        for name, s in shadow.items():
            if s.dtype.is_floating_point:
                sent = s.double() - before[name].double()
                wanted = global_state[name].double() - before[name].double()
                tol = 1e-2 if s.dtype is torch.bfloat16 else 1e-5
                torch.testing.assert_close(gap[name].double(), wanted - sent, rtol=0, atol=tol)
                torch.testing.assert_close(
                    s.double() + gap[name].double(), global_state[name].double(), rtol=0, atol=tol
                )
            else:
                assert torch.equal(s, global_state[name])


@pytest.mark.parametrize(
    "spec,rounds", [("topk:0.1", 40), ("int8", 6), ("fp16", 6), ("powersgd:4", 60), ("int8+zstd", 6)]
)
def test_repeated_syncs_close_the_gap_to_a_fixed_global(spec: str, rounds: int) -> None:
    initial = _model()
    global_state = _step(_step(initial, 1, scale=1.0), 2, scale=1.0)
    server = ShadowModel(initial, codec=CodecSpec.parse(spec))
    sizes = []
    for _ in range(rounds):
        update, _ = server.sync(global_state)
        sizes.append(update.nbytes)
    gap = max(float(g.abs().max()) for g in server.gap(global_state).values())
    assert gap < 1e-6, gap
    assert sum(sizes) / len(sizes) < sum(v.numel() * v.element_size() for v in initial.values())


def test_a_client_that_missed_rounds_catches_up() -> None:
    initial = _model()
    server = ShadowModel(
        initial, codec=CodecSpec.parse("topk:0.05"), catch_up_codec=CodecSpec.parse("none+zstd")
    )
    late = OrderedDict((k, v.clone()) for k, v in initial.items())
    global_state = initial
    updates: list[DownlinkUpdate] = []
    for r in range(6):
        global_state = _step(global_state, r)
        updates.append(server.sync(global_state)[0])
    late = apply_downlink(late, updates[0], held_version=0)
    with pytest.raises(
        InvalidUpdateError, match=r"update applies to version 5, client holds 1: needs a catch-up"
    ):
        apply_downlink(late, updates[-1], held_version=1)
    full = server.catch_up()
    assert full.is_full and full.version == 6 and full.codec.text == "none+zstd"
    late = apply_downlink(late, full)
    assert _same_bits(late, server.shadow)
    newcomer = apply_downlink(_model(seed=99), full)  # a new client: only specs matter
    assert _same_bits(newcomer, server.shadow)
    global_state = _step(global_state, 7)
    update, shadow = server.sync(global_state)
    assert _same_bits(apply_downlink(late, update, held_version=full.version), shadow)


def test_shadow_state_dict_resumes_bit_for_bit() -> None:
    initial = _model()
    a = ShadowModel(initial, codec=CodecSpec.parse("powersgd:2"))
    g = initial
    for r in range(3):
        g = _step(g, r)
        a.sync(g)
    b = ShadowModel(_model(seed=5), codec=CodecSpec.parse("powersgd:2"))
    b.load_state_dict(a.state_dict())
    g = _step(g, 9)
    ua, sa = a.sync(g)
    ub, sb = b.sync(g)
    assert ua == ub and _same_bits(dict(sa), dict(sb)) and b.version == 4
    with pytest.raises(ValueError, match=r"shadow state is for codec 'powersgd:2'"):
        ShadowModel(initial, codec=CodecSpec.parse("int8")).load_state_dict(a.state_dict())


def test_downlink_rejects_bad_input() -> None:
    initial = _model()
    server = ShadowModel(initial, codec=CodecSpec.parse("int8"))
    update, _ = server.sync(_step(initial, 0))
    payloads = dict(update.payloads)
    del payloads["fc.bias"]
    with pytest.raises(InvalidUpdateError, match=r"missing tensors \['fc.bias'\]"):
        apply_downlink(initial, DownlinkUpdate(1, 0, CodecSpec.parse("int8"), payloads))
    payloads = dict(update.payloads, **{"fc.weight": update.payloads["fc.weight"][:-3]})
    with pytest.raises(InvalidUpdateError, match=r"tensor 'fc.weight': int8 payload: truncated"):
        apply_downlink(initial, DownlinkUpdate(1, 0, CodecSpec.parse("int8"), payloads))
    with pytest.raises(
        InvalidUpdateError, match=r"tensor 'fc.bias': torch.float64 \[32\], expected torch.float32 \[32\]"
    ):
        server.sync(dict(initial, **{"fc.bias": initial["fc.bias"].double()}))
    with pytest.raises(InvalidUpdateError, match=r"tensor names differ"):
        apply_delta(initial, {"x": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"catch-up codec must be lossless"):
        ShadowModel(initial, codec=CodecSpec.parse("int8"), catch_up_codec=CodecSpec.parse("fp16"))
    with pytest.raises(ConfigError, match=r"config key 'downlink_codec'.*'qsgd:4' is not contractive"):
        ShadowModel(initial, codec=CodecSpec.parse("qsgd:4"))


def test_shadow_keeps_one_model_whatever_the_clients() -> None:
    initial = _model()
    server = ShadowModel(initial, codec=CodecSpec.parse("topk:0.05"))
    assert list(server.shadow) == list(initial)
    update, shadow = server.sync(_step(initial, 0))
    assert (
        update.codec_for(torch.float32).name == "topk:0.05" and update.codec_for(torch.int64).name == "none"
    )
    assert not any(s is v for s, v in zip(shadow.values(), initial.values()))  # initial was copied
    assert update.nbytes < 0.2 * sum(v.numel() * v.element_size() for v in initial.values())
