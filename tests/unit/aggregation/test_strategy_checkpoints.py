"""Every strategy's ``state_dict`` round trip: a resumed run is bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest
import safetensors.torch
import torch

from fedgrid.aggregation import STRATEGIES, FedAdam, Strategy, build_strategy_from
from fedgrid.server.state import decode_state, encode_state

from aggsim import clients, model_state, run_round

ROUNDS, STOP = 5, 2


# Every registered strategy, plus a few with a robust aggregator or a non-default schedule.
def _registered(name: str) -> Callable[[], Strategy]:
    return lambda: build_strategy_from(name, fraction_fit=0.7, seed=3)


CASES: dict[str, Callable[[], Strategy]] = {name: _registered(name) for name in STRATEGIES}
CASES.update(
    {
        "fedadam+median": lambda: build_strategy_from("fedadam", aggregator="median", seed=3),
        "scaffold+trimmed-mean": lambda: build_strategy_from(
            "scaffold", aggregator="trimmed-mean", aggregator_beta=0.2, seed=3
        ),
        "diloco+centered-clip": lambda: build_strategy_from(
            "diloco", aggregator="centered-clip", aggregator_tau=0.5
        ),
        "bcd-random": lambda: build_strategy_from("bcd", num_blocks=3, block_schedule="random", seed=3),
        "bcd-capacity": lambda: build_strategy_from("bcd", num_blocks=3, block_schedule="capacity"),
        "streaming-diloco-3": lambda: build_strategy_from("streaming-diloco", num_fragments=3),
    }
)


def _through_disk(state: dict[str, Any]) -> dict[str, Any]:
    """Through the checkpoint format (JSON and safetensors, no pickle: ``server/state.py``)."""
    doc, tensors = encode_state(state)
    return decode_state(
        json.loads(json.dumps(doc, allow_nan=False)), safetensors.torch.load(safetensors.torch.save(tensors))
    )


def _assert_same(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_run_is_bit_identical(case):
    make = CASES[case]
    live = clients(10, memory=[(7 * i) % 10 for i in range(10)])

    straight = make()
    straight.initialize(initial_state=model_state())
    straight_metrics = [run_round(straight, r, live, drop=r % 2) for r in range(1, ROUNDS + 1)]

    first = make()
    first.initialize(initial_state=model_state())
    for r in range(1, STOP + 1):
        run_round(first, r, live, drop=r % 2)
    saved = _through_disk(first.state_dict())
    resumed = make()
    resumed.load_state_dict(saved)
    resumed_metrics = [run_round(resumed, r, live, drop=r % 2) for r in range(STOP + 1, ROUNDS + 1)]

    assert resumed_metrics == straight_metrics[STOP:]
    for name, t in straight.global_state.items():
        assert torch.equal(resumed.global_state[name], t), name
    _assert_same(straight.state_dict(), resumed.state_dict())
    # What the strategy remembers of clients (e.g. streaming DiLoCo's last round per client,
    # which decides what each downloads) came back too: the next round's tasks are the same.
    assert resumed.configure_round(server_round=ROUNDS + 1, clients=live) == straight.configure_round(
        server_round=ROUNDS + 1, clients=live
    )
    if case.startswith("streaming-diloco"):
        assert straight.state_dict()["last_round"] and saved["last_round"]
    initial = model_state()
    assert any(
        not torch.equal(straight.global_state[n], initial[n]) for n in initial
    )  # the runs did something


@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_is_a_snapshot(case):
    strategy = CASES[case]()
    strategy.initialize(initial_state=model_state())
    run_round(strategy, 1, clients(10))
    state = strategy.state_dict()
    copy = _through_disk(state)
    run_round(strategy, 2, clients(10))
    strategy.global_state["enc.weight"].add_(1.0)
    _assert_same(state, copy)  # later rounds and in-place edits leave the snapshot alone


def test_loading_another_strategys_checkpoint_fails_and_changes_nothing():
    adam = FedAdam()
    adam.initialize(initial_state=model_state())
    run_round(adam, 1, clients(3))
    for name in ("fedyogi", "fedavgm", "bcd"):
        other = build_strategy_from(name)
        other.initialize(initial_state=model_state())
        with pytest.raises(ValueError):
            other.load_state_dict(adam.state_dict())
        for key, t in model_state().items():
            assert torch.equal(other.global_state[key], t)


def test_checkpoint_with_other_partition_is_refused():
    a = build_strategy_from("bcd", num_blocks=2)
    a.initialize(initial_state=model_state())
    b = build_strategy_from("bcd", num_blocks=3)
    with pytest.raises(ValueError, match="block partition"):
        b.load_state_dict(a.state_dict())
    c = build_strategy_from("streaming-diloco", num_fragments=2)
    c.initialize(initial_state=model_state())
    with pytest.raises(ValueError, match="fragments"):
        build_strategy_from("streaming-diloco", num_fragments=3).load_state_dict(c.state_dict())
