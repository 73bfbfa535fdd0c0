"""The coordinator's memory on its accept-and-aggregate path, counted in torch storages: a
20M-parameter model (80 MB in float32) uploaded by two clients into a ``RemoteFleet`` (the
frames a client sends, through ``RemoteFleet.upload``: assembly, checks, the held spill) and
aggregated by DiLoCo (mean of the pseudo-gradients, Nesterov outer step); then whole rounds
through the ``RoundEngine`` with a state directory: the rollback point, aggregation and the
outer step, the NaN check, and the commit's checkpoint; and a round whose outer step overflows,
which goes back to the state it began with.

Every tensor storage an op creates is counted (``StorageMeter``: a ``TorchDispatchMode``), and
freed when its last tensor goes; receive buffers come from the process's numpy pool, so the
acceptance path is measured by what torch adds on top of them. The bounds are what the path
needs (issue 40, item 1), each with less than one model of room: a full-model copy added on
decode, acceptance or the outer step fails the test.
"""

from __future__ import annotations

import threading
import tracemalloc
from collections import OrderedDict
from datetime import timedelta
from typing import Any

import pytest
import torch

from fedgrid.aggregation.diloco import DiLoCo
from fedgrid.proto import serde
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import RunIO, Schedule
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.round_failures import ROUND_FAILED
from fedgrid.server.state import StateStore
from fedgrid.types import ClientInfo, FitIns

from harness import wait_until
from storage_meter import StorageMeter

pytestmark = pytest.mark.timeout(120)

NUM_PARAMS = 20_000_000
MODEL_BYTES = NUM_PARAMS * 4


def _model(seed: int, scale: float = 1.0, sizes: tuple[int, ...] = ()) -> "OrderedDict[str, torch.Tensor]":
    """20M parameters; by default two large matrices, a smaller one and a bias."""
    gen = torch.Generator().manual_seed(seed)
    sizes = sizes or (8_000_000, 8_000_000, 3_999_000, 1_000)
    return OrderedDict(
        (f"layer{i}.weight", torch.randn(n, generator=gen) * scale) for i, n in enumerate(sizes)
    )


def test_meter_counts_new_storages_not_views_or_in_place_ops():
    base = torch.ones(1000)
    with StorageMeter() as meter:
        doubled = base * 2  # 4000 bytes
        base.add_(1)  # in place: nothing new
        view = doubled.view(10, 100)  # a view: nothing new
        copy = view.clone()  # 4000 bytes more
        del doubled, view
        del copy
    assert (meter.total, meter.peak, meter.now) == (8000, 8000, 0)


def test_accepting_and_aggregating_a_20m_model_adds_no_full_model_copy():
    global_state = _model(0)
    assert sum(t.numel() for t in global_state.values()) == NUM_PARAMS
    strategy = DiLoCo(outer_lr=0.7, outer_momentum=0.9)
    strategy.initialize(initial_state=global_state)
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=600))
    try:
        joined = [fleet.join(ClientInfo("", name=f"site-{i}", num_examples=10)) for i in range(2)]
        outcome: list[Any] = []
        round_thread = threading.Thread(
            target=lambda: outcome.append(
                fleet.fit_round(
                    server_round=1,
                    global_state=strategy.global_state,
                    assignments=[(info, FitIns(round=1)) for info, _ in joined],
                    timeout=timedelta(seconds=60),
                )
            ),
            daemon=True,
        )
        round_thread.start()
        wait_until(lambda: fleet.current_round is not None, timeout=30, what="round 1's tasks")
        task_id = fleet.current_round.task_id  # type: ignore[union-attr]
        updates = [
            OrderedDict((n, t + d) for (n, t), d in zip(global_state.items(), _model(1 + i, 1e-3).values()))
            for i in range(2)
        ]
        encoded = [serde.EncodedModel(u) for u in updates]  # what the clients send, made before the count
        with StorageMeter() as accepting:
            for (info, token), enc in zip(joined, encoded):
                info_ = serde.StreamInfo(
                    run_id=fleet.run_id, task_id=task_id, round=1, client_id=info.client_id, num_examples=10
                )
                assert fleet.upload(enc.frames(info_), token) == MODEL_BYTES
        del encoded
        round_thread.join(60)
        assert not round_thread.is_alive() and len(outcome[0].results) == 2
        results = outcome[0].results
        with StorageMeter() as aggregating:
            strategy.aggregate(server_round=1, results=results, failures=[])
        new_state = strategy.global_state
    finally:
        fleet.close()

    # The model moved by the outer step: mean pseudo-gradient g = global - mean(updates),
    # momentum m = g, step lr * (g + momentum * m) (Nesterov), all from global_state.
    mean = OrderedDict((n, (updates[0][n].double() + updates[1][n].double()) / 2) for n in global_state)
    name = "layer0.weight"
    gradient = global_state[name].double() - mean[name]
    expected = global_state[name].double() - 0.7 * (gradient + 0.9 * gradient)
    torch.testing.assert_close(new_state[name].double(), expected, rtol=0, atol=1e-5)

    # Acceptance: the received buffers are the tensors (checked in place, held, not copied).
    assert accepting.total < 0.05 * MODEL_BYTES, (
        f"acceptance made {accepting.total / MODEL_BYTES:.2f}x the model"
    )
    # Aggregation (measured 2.40x peak, 8.00x in all): the outer momentum (1x, made in round
    # 1), the new model (1x), and one tensor's float64 accumulator, pseudo-gradient and
    # Nesterov term at a time (the largest tensor is 0.4x). Before it went tensor by tensor,
    # mean then step: 4.20x and 9.00x.
    peak, total = aggregating.peak / MODEL_BYTES, aggregating.total / MODEL_BYTES
    assert peak <= 2.7, f"aggregation held {peak:.2f}x the model at its peak"
    assert total <= 8.5, f"aggregation made {total:.2f}x the model"


def _upload(
    fleet: RemoteFleet,
    joined: list[tuple[ClientInfo, str]],
    server_round: int,
    updates: list[Any],
    errors: list[BaseException],
) -> None:
    """Each client's model sent through ``RemoteFleet.upload`` once the round's tasks are out
    (or the round's thread failed: ``errors``)."""
    wait_until(
        lambda: (
            errors or (fleet.current_round is not None and fleet.current_round.server_round == server_round)
        ),
        timeout=90,
        what=f"round {server_round}'s tasks",
    )
    assert not errors, errors
    task_id = fleet.current_round.task_id  # type: ignore[union-attr]
    for (info, token), update in zip(joined, updates):
        stream = serde.StreamInfo(
            run_id=fleet.run_id,
            task_id=task_id,
            round=server_round,
            client_id=info.client_id,
            num_examples=10,
        )
        assert fleet.upload(serde.EncodedModel(update).frames(stream), token) == MODEL_BYTES


#: A model's layout as language models have it: 40 matrices of 0.5M (a 155M Llama's largest
#: tensor is 1.5% of it), so one tensor's temporaries are small beside a full-model copy.
LAYERS = (500_000,) * 40


def _moved(state: Any, seed: int, scale: float) -> "OrderedDict[str, torch.Tensor]":
    return OrderedDict((n, t + d) for (n, t), d in zip(state.items(), _model(seed, scale, LAYERS).values()))


@pytest.mark.timeout(300)
def test_whole_rounds_through_the_engine_and_their_commit_add_no_full_model_copy(tmp_path):
    """Round 2 of DiLoCo (the outer momentum exists) through ``run_round`` and ``commit``: its
    rollback point goes to disk, the NaN check and the checkpoint read the strategy's own tensors.
    Round 3's outer step overflows: the round fails and the state is the one round 2 committed."""
    strategy = DiLoCo(outer_lr=0.7, outer_momentum=0.9)
    strategy.initialize(initial_state=_model(0, sizes=LAYERS))
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=600))
    store = StateStore(tmp_path / "state")
    engine = RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=3, min_clients=2, round_timeout=timedelta(seconds=60), join_timeout=timedelta(seconds=30)
        ),
        io=RunIO(store=store),
    )
    meters: dict[int, tuple[StorageMeter, int]] = {}
    metrics: dict[int, Any] = {}
    errors: list[BaseException] = []

    def play(server_round: int) -> None:
        try:
            if server_round == 2:  # Python objects too (the checkpoint's bytes would be some)
                tracemalloc.start()
            with StorageMeter() as meter:
                metrics[server_round] = engine.run_round(server_round)
                engine.commit(metrics[server_round])
            meters[server_round] = (meter, tracemalloc.get_traced_memory()[1] if server_round == 2 else 0)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
        finally:
            tracemalloc.stop()

    try:
        joined = [fleet.join(ClientInfo("", name=f"site-{i}", num_examples=10)) for i in range(2)]
        committed = None
        for server_round in (1, 2, 3):
            thread = threading.Thread(target=play, args=(server_round,), daemon=True)
            thread.start()
            base = strategy.global_state
            updates = [_moved(base, 10 * server_round + i, 1e-3) for i in range(2)]
            if server_round == 3:  # finite updates whose outer step overflows float32
                updates = [OrderedDict((n, t + 3e38) for n, t in u.items()) for u in updates]
            _upload(fleet, joined, server_round, updates, errors)
            thread.join(90)
            assert not thread.is_alive() and not errors, errors
            if server_round == 2:
                committed = {k: v.clone() for k, v in strategy.global_state.items()}
                momentum = {k: v.clone() for k, v in strategy.server_optimizer._buffers["momentum"].items()}
    finally:
        fleet.close()

    # Round 2, whole: the new model (1x) and one tensor's float64 accumulator, pseudo-gradient and
    # Nesterov term at a time: measured 1.05x at the peak (round 1 also makes the momentum: 2.05x).
    # A copy of the state for rollback, for the NaN check or for the checkpoint adds 2x (model and
    # momentum): 3.05x before the rollback point went to disk and the check and the checkpoint
    # read the strategy's own tensors.
    meter, heap_peak = meters[2]
    peak = meter.peak / MODEL_BYTES
    assert peak <= 1.5, f"round 2 and its commit held {peak:.2f}x the model at the peak"
    assert meters[1][0].peak / MODEL_BYTES <= 2.5, f"round 1 held {meters[1][0].peak / MODEL_BYTES:.2f}x"
    # The checkpoint and the rollback point stream from the tensors: no bytes copy of the state.
    assert heap_peak < 0.1 * MODEL_BYTES, (
        f"round 2 held {heap_peak / MODEL_BYTES:.2f}x the model in Python objects"
    )
    assert store.load_latest().round == 2  # type: ignore[union-attr]

    # Round 3 failed and went back, bit for bit, to the state round 2 committed.
    assert metrics[3].extra[ROUND_FAILED] == 1.0
    for name, tensor in committed.items():  # type: ignore[union-attr]
        assert torch.equal(strategy.global_state[name], tensor), name
        assert torch.equal(strategy.server_optimizer._buffers["momentum"][name], momentum[name]), name
    # Going back loads the state from its file (2x) beside the failed round's model: measured 3.0x.
    meter, _ = meters[3]
    assert meter.peak / MODEL_BYTES <= 3.5, (
        f"the failed round held {meter.peak / MODEL_BYTES:.2f}x at the peak"
    )
