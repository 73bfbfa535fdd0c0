"""Streaming DiLoCo's uplink under momentum error feedback: each fragment keeps its own residual,
decayed once per sync of that fragment (its outer step), never by the rounds that sync the others."""

from __future__ import annotations

import pytest
import torch

from fedgrid.client.uplink import UplinkEncoder
from fedgrid.compression.spec import CodecSpec


@pytest.mark.parametrize("codec", ["sparseloco", "demo"])
def test_each_fragment_carries_its_own_residual_once_per_sync(codec: str) -> None:
    gen = torch.Generator().manual_seed(11)
    fragments = [("a.weight", "a.bias"), ("b.weight#rows=0:64", "b.weight#rows=64:128")]
    shapes = {
        "a.weight": (64, 80),
        "a.bias": (5000,),
        "b.weight#rows=0:64": (64, 90),
        "b.weight#rows=64:128": (64, 90),
    }
    task = {"uplink_feedback": "momentum:0.95", "seed": 3}
    encoder = UplinkEncoder(CodecSpec.parse(codec))
    expected: dict[str, torch.Tensor] = {}
    for server_round in range(1, 9):  # fragment r % 2 syncs in round r, as streaming DiLoCo's
        names = fragments[server_round % 2]
        other = {n: r.clone() for n, r in encoder.feedback.residuals.items() if n not in names}
        global_state = {n: torch.randn(shapes[n], generator=gen) for n in names}
        new_state = {n: g + 0.01 * torch.randn(shapes[n], generator=gen) for n, g in global_state.items()}
        encoded, delta = encoder.begin(server_round, task, "worker-0").encode(
            global_state=global_state, new_state=new_state
        )
        assert delta and sorted(name for name, _, _ in encoded.payloads()) == sorted(names)
        for n in names:  # v = 0.95 e + x for this fragment's tensors only; e <- v - D(C(v))
            v = (new_state[n] - global_state[n]) + 0.95 * expected.get(n, torch.zeros(shapes[n]))
            codec_ = encoder.feedback.codec
            expected[n] = v - codec_.decode(codec_.encode(v), dtype=v.dtype, shape=tuple(v.shape))
            torch.testing.assert_close(encoder.feedback.residuals[n], expected[n], rtol=0, atol=1e-6)
        for n, before in other.items():  # the fragments not synced this round: untouched
            assert torch.equal(encoder.feedback.residuals[n], before), (server_round, n)
    assert set(encoder.feedback.residuals) == {n for f in fragments for n in f}
