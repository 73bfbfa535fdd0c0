"""Streaming DiLoCo fragments that split a dominant tensor by rows (``blocks.default_blocks``
with ``split_rows``), and the server's outer step on those row slices."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from fedgrid.aggregation import StreamingDiLoCo
from fedgrid.aggregation.blocks import (
    default_blocks,
    joined_state,
    parse_row_slice,
    row_slice_name,
    row_slices,
    sliced_state,
)
from fedgrid.types import ClientInfo, FitRes, TensorSpec

from aggsim import model_state

F32 = torch.float32


def _mlp_specs(hidden: int) -> "OrderedDict[str, TensorSpec]":
    """The specs of ``64 -> hidden -> hidden -> 10``: the middle weight dominates."""
    shapes = [
        ("0.weight", (hidden, 64)),
        ("0.bias", (hidden,)),
        ("2.weight", (hidden, hidden)),
        ("2.bias", (hidden,)),
        ("4.weight", (10, hidden)),
        ("4.bias", (10,)),
    ]
    return OrderedDict((name, TensorSpec(F32, shape)) for name, shape in shapes)


def _bytes(block, specs) -> int:
    """A block's bytes: whole tensors, or the rows a slice names."""
    total = 0
    for name in block.names:
        part = parse_row_slice(name)
        spec = specs[name if part is None else part[0]]
        total += spec.nbytes if part is None else spec.nbytes // spec.shape[0] * (part[2] - part[1])
    return total


@pytest.mark.parametrize("count", [2, 3, 4, 6])
def test_a_dominant_layer_is_split_so_every_fragment_is_within_one_row_of_a_fair_share(count):
    specs = _mlp_specs(2048)  # 4.4M parameters, 2.weight 96% of the bytes
    total = sum(s.nbytes for s in specs.values())
    row = 2048 * 4
    blocks = default_blocks(specs, count, split_rows=True)
    sizes = [_bytes(b, specs) for b in blocks]
    assert sum(sizes) == total and sum(b.numel for b in blocks) * 4 == total
    for size in sizes:
        assert abs(size - total / count) <= row, (sizes, total / count)
    # The slices of 2.weight cover its rows once, in order, one range per fragment.
    slices = row_slices(blocks)
    assert list(slices) == ["2.weight"]
    ranges = [(start, stop) for _, start, stop in slices["2.weight"]]
    assert ranges[0][0] == 0 and ranges[-1][1] == 2048
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and len(ranges) == count
    flat = [n for b in blocks for n in b.names]
    assert [n for n in flat if parse_row_slice(n) is None] == [n for n in specs if n != "2.weight"]


def test_two_fragments_of_the_dominant_mlp_hand_checked():
    specs = _mlp_specs(2048)
    first, second = default_blocks(specs, 2, split_rows=True)
    # total 17,399,848 bytes; the fair share 8,699,924 falls 997.8 rows into 2.weight (after
    # 0.weight and 0.bias, 532,480 bytes): the cut is at row 997, the nearest row boundary.
    assert first.prefixes == ("0", "2.weight#rows=0:997")
    assert second.prefixes == ("2.weight#rows=997:2048", "2.bias", "4")
    assert first.names == ("0.weight", "0.bias", "2.weight#rows=0:997")
    assert second.names == ("2.weight#rows=997:2048", "2.bias", "4.weight", "4.bias")
    assert [_bytes(b, specs) for b in (first, second)] == [8_699_904, 8_699_944]


@pytest.mark.parametrize("count", [1, 2, 3])
def test_a_model_whose_tensors_all_fit_keeps_todays_fragments(count):
    specs = TensorSpec.of(model_state())  # no tensor above total / count for these counts
    assert default_blocks(specs, count, split_rows=True) == default_blocks(specs, count)


def test_a_stack_of_blocks_under_one_module_is_cut_between_its_tensors():
    """A transformer's layers under one module (``blocks.0``, ``blocks.1``, ...) hold most of its
    bytes and no tensor above a fair share: the stack is cut between tensors."""
    shapes = [("emb.weight", (80, 64))]
    for layer in range(4):
        shapes += [(f"blocks.{layer}.attn.weight", (192, 64)), (f"blocks.{layer}.mlp.weight", (256, 64))]
    shapes += [("head.weight", (80, 64))]
    specs = OrderedDict((name, TensorSpec(F32, shape)) for name, shape in shapes)
    total = sum(spec.nbytes for spec in specs.values())
    first, second = default_blocks(specs, 2, split_rows=True)
    # Whole modules would be emb | blocks + head: 20,480 against 479,232 bytes.
    assert first.names == (
        "emb.weight",
        "blocks.0.attn.weight",
        "blocks.0.mlp.weight",
        "blocks.1.attn.weight",
        "blocks.1.mlp.weight",
    )
    assert [_bytes(b, specs) for b in (first, second)] == [249_856, 249_856]
    assert all(abs(_bytes(b, specs) - total / 2) <= 65_536 for b in (first, second))  # within one tensor
    assert all(parse_row_slice(n) is None for b in (first, second) for n in b.names)


def test_bcd_blocks_never_split():
    specs = _mlp_specs(256)
    assert all(parse_row_slice(n) is None for b in default_blocks(specs, 3) for n in b.names)


def test_sliced_and_joined_state_round_trip():
    state = OrderedDict(a=torch.arange(12.0).reshape(6, 2), b=torch.ones(3))
    slices = {"a": [(row_slice_name("a", 0, 2), 0, 2), (row_slice_name("a", 2, 6), 2, 6)]}
    sliced = sliced_state(state, slices)
    assert list(sliced) == ["a#rows=0:2", "a#rows=2:6", "b"]
    assert torch.equal(sliced["a#rows=2:6"], state["a"][2:])
    joined = joined_state(sliced)
    assert list(joined) == ["a", "b"] and torch.equal(joined["a"], state["a"]) and joined["b"] is state["b"]
    assert sliced_state(state, {}) is state
    with pytest.raises(ValueError, match="do not cover its rows once"):
        joined_state(OrderedDict((n, t) for n, t in sliced.items() if n != "a#rows=0:2"))
    assert parse_row_slice("a.weight") is None and parse_row_slice("a#rows=x:2") is None


# -- the server: the outer step on row slices, hand-computed -----------------------------------------
W0 = torch.arange(8.0).reshape(4, 2)  # 32 bytes of the model's 40: split at F = 2
B0 = torch.tensor([1.0, -1.0])
A, B = (ClientInfo(client_id=f"id-{n}", name=n, num_examples=k) for n, k in (("a", 1), ("b", 3)))


def _strategy() -> StreamingDiLoCo:
    strategy = StreamingDiLoCo(num_fragments=2, outer_lr=0.5, outer_momentum=0.5)
    strategy.initialize(initial_state=OrderedDict(w=W0.clone(), b=B0.clone()))
    return strategy


def _round(strategy: StreamingDiLoCo, server_round: int, shifts: dict[str, float]) -> None:
    """Each client uploads the global values of the round's fragment plus its shift."""
    pairs = strategy.configure_round(server_round=server_round, clients=[A, B])
    sent = strategy.downlink_state(server_round=server_round)
    results = []
    for client, ins in pairs:
        assert ins.expected is not None
        state = OrderedDict((n, sent[n] + shifts[client.name]) for n in ins.expected)
        results.append(FitRes(client, state, num_examples=client.num_examples))
    strategy.aggregate(server_round=server_round, results=results, failures=[])


def test_a_streaming_round_on_a_split_tensor_steps_only_its_rows():
    strategy = _strategy()
    first, second = strategy.fragments
    # Rows of 8 bytes, b 8 bytes, 40 in all: the fair share (20) is half-way between 2 and 3
    # rows of w; the tie goes to the lower cut.
    assert first.names == ("w#rows=0:2",) and second.names == ("w#rows=2:4", "b")
    ins = strategy.configure_round(server_round=1, clients=[A])[0][1]
    assert ins.expected == OrderedDict(
        [("w#rows=2:4", TensorSpec(F32, (2, 2))), ("b", TensorSpec(F32, (2,)))]
    )
    assert ins.config["fragment_prefixes"] == "w#rows=2:4,b"
    assert ins.download is None and ins.config["merge_fragment_prefixes"] == "w#rows=0:2,w#rows=2:4,b"
    assert list(strategy.downlink_state(server_round=1)) == ["w#rows=0:2", "w#rows=2:4", "b"]

    # Round 1 syncs fragment 1. Mean shift (1 * 1 + 3 * 2) / 4 = 1.75, so g = -1.75; Nesterov
    # with lr 0.5, mu 0.5: buf = g, x -= 0.5 * (g + 0.5 * buf) = x + 1.3125.
    _round(strategy, 1, {"a": 1.0, "b": 2.0})
    w = strategy.global_state["w"]
    assert torch.equal(w[:2], W0[:2]) and torch.equal(w[2:], W0[2:] + 1.3125)
    assert torch.equal(strategy.global_state["b"], B0 + 1.3125)
    momentum = strategy.server_optimizer.state_dict()["buffers"]["momentum"]
    assert set(momentum) == {"w#rows=2:4", "b"} and torch.equal(
        momentum["w#rows=2:4"], torch.full((2, 2), -1.75)
    )

    # Round 2 syncs fragment 0, its own momentum from zero: rows 0:2 + 1.3125, the rest as it was.
    _round(strategy, 2, {"a": 1.0, "b": 2.0})
    assert torch.equal(strategy.global_state["w"], torch.cat([W0[:2] + 1.3125, W0[2:] + 1.3125]))
    assert torch.equal(strategy.global_state["b"], B0 + 1.3125)

    # Round 3 syncs fragment 1 again: g = -2, buf = 0.5 * -1.75 - 2 = -2.875,
    # x -= 0.5 * (-2 + 0.5 * -2.875) = x + 1.71875.
    _round(strategy, 3, {"a": 2.0, "b": 2.0})
    w = strategy.global_state["w"]
    assert torch.equal(w[:2], W0[:2] + 1.3125) and torch.equal(w[2:], W0[2:] + 1.3125 + 1.71875)
    assert torch.equal(strategy.global_state["b"], B0 + 1.3125 + 1.71875)
    assert list(strategy.global_state) == ["w", "b"]  # the global model keeps whole tensors


def test_checkpoint_round_trips_and_an_old_one_with_whole_buffers_loads_as_slices():
    strategy = _strategy()
    _round(strategy, 1, {"a": 1.0, "b": 2.0})
    saved = strategy.state_dict()
    restored = StreamingDiLoCo(num_fragments=2, outer_lr=0.5, outer_momentum=0.5)
    restored.load_state_dict(saved)
    for s in (strategy, restored):
        _round(s, 2, {"a": 1.0, "b": 3.0})
        _round(s, 3, {"a": -1.0, "b": 2.0})
    for name, tensor in strategy.global_state.items():
        assert torch.equal(restored.global_state[name], tensor), name

    # A checkpoint written before fragments split tensors keeps w's momentum whole.
    whole = torch.arange(8.0).reshape(4, 2) / 8
    old = {**saved, "server_optimizer": {**saved["server_optimizer"], "buffers": {"momentum": {"w": whole}}}}
    loaded = StreamingDiLoCo(num_fragments=2, outer_lr=0.5, outer_momentum=0.5)
    loaded.load_state_dict(old)
    momentum = loaded.server_optimizer.state_dict()["buffers"]["momentum"]
    assert list(momentum) == ["w#rows=0:2", "w#rows=2:4"]
    assert torch.equal(momentum["w#rows=0:2"], whole[:2]) and torch.equal(momentum["w#rows=2:4"], whole[2:])
