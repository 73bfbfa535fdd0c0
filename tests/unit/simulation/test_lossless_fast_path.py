"""The lossless fast path of ``InProcessFleet``: a raw (``none``) uplink skips the simulated
wire, and a run is the same with it as without, bit for bit (the model), byte for byte
(``bytes_up``/``bytes_down`` of every round) and metric for metric. A lossy codec, and an
update the wire would refuse, take the wire's path."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from fedgrid.client.api import Client, FitOutput
from fedgrid.config import load_config
from fedgrid.proto import serde
from fedgrid.simulation import fleet as fleet_mod
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.simulation.run import run_simulation
from fedgrid.simulation.upload import raw_passes
from fedgrid.telemetry import without_timing
from fedgrid.types import FitIns, TensorSpec


def _run(tmp_path, fast: bool, monkeypatch, **overrides):
    monkeypatch.setattr(InProcessFleet, "fast_lossless", fast)
    config = load_config(
        None,
        {
            "rounds": 3,
            "clients": 6,
            "seed": 1,
            "threads": 1,
            "out": str(tmp_path / f"fast-{fast}"),
            **overrides,
        },
    )
    return run_simulation(config)


@pytest.mark.parametrize("engine", ["sequential", "batched"])
def test_the_fast_path_changes_no_bit_and_no_byte(tmp_path, monkeypatch, engine):
    calls = []
    original = serde.stream_wire_bytes
    monkeypatch.setattr(
        fleet_mod.serde, "stream_wire_bytes", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    final_fast, fast = _run(tmp_path, True, monkeypatch, engine=engine)
    assert len(calls) == 3 * 6  # every update took it
    final_wire, wire = _run(tmp_path, False, monkeypatch, engine=engine)
    assert len(calls) == 3 * 6  # the wire's path counted its frames instead
    for name, tensor in final_wire.items():
        assert torch.equal(final_fast[name], tensor), name
    for a, b in zip(fast, wire):
        assert (a.round, a.bytes_up, a.bytes_down, a.clients_ok, a.loss, a.accuracy) == (
            b.round,
            b.bytes_up,
            b.bytes_down,
            b.clients_ok,
            b.loss,
            b.accuracy,
        )
    assert fast[0].bytes_up > 0


def test_a_lossy_codec_takes_the_wire(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(fleet_mod.serde, "stream_wire_bytes", lambda *a, **k: calls.append(1) or 0)
    _, history = _run(tmp_path, True, monkeypatch, codec="int8")
    assert calls == [] and history[-1].bytes_up > 0


class Odd(Client):
    """Returns whatever the test sets."""

    name = "odd"

    def __init__(self, out):
        self.out = out

    @property
    def num_examples(self) -> int:
        return 3

    def fit(self, state, ins):
        return self.out


def test_what_the_wire_would_refuse_or_change_takes_the_wire():
    state = OrderedDict(w=torch.ones(2, 3), s=torch.tensor(4))
    expected = TensorSpec.of(state)
    assert raw_passes(FitOutput(state, 3, {"loss": 0.5}), expected)
    assert not raw_passes(
        FitOutput(OrderedDict(w=torch.ones(3, 2), s=torch.tensor(4)), 3, {}), expected
    )  # wrong shape
    assert not raw_passes(FitOutput(OrderedDict(w=torch.ones(2, 3)), 3, {}), expected)  # a tensor missing
    assert not raw_passes(FitOutput(state, -1, {}), expected)  # protobuf cannot carry it
    assert not raw_passes(FitOutput(state, 3, {"loss": "low"}), expected)  # not a number
    # The refusals read as on the wire: a wrong shape, a bad metric name.
    fleet = InProcessFleet([Odd(FitOutput(OrderedDict(w=torch.ones(3, 2), s=torch.tensor(4)), 3, {}))])
    [info] = fleet.wait_for_clients(min_clients=1, timeout=None)  # type: ignore[arg-type]
    outcome = fleet.fit_round(
        server_round=1, global_state=state, assignments=[(info, FitIns(round=1))], timeout=None
    )  # type: ignore[arg-type]
    assert outcome.results == [] and "wrong shape [3, 2], expected [2, 3]" in outcome.failures[0].reason
    fleet = InProcessFleet(
        [Odd(FitOutput(OrderedDict(w=torch.ones(2, 3), s=torch.tensor(4)), 3, {"lo\nss": 1.0}))]
    )
    [info] = fleet.wait_for_clients(min_clients=1, timeout=None)  # type: ignore[arg-type]
    outcome = fleet.fit_round(
        server_round=1, global_state=state, assignments=[(info, FitIns(round=1))], timeout=None
    )  # type: ignore[arg-type]
    assert outcome.results == [] and "metric name" in outcome.failures[0].reason
    fleet = InProcessFleet(
        [Odd(FitOutput(OrderedDict(w=torch.full((2, 3), 2.0), s=torch.tensor(5)), 3, {"loss": 1}))]
    )
    [info] = fleet.wait_for_clients(min_clients=1, timeout=None)  # type: ignore[arg-type]
    outcome = fleet.fit_round(
        server_round=1, global_state=state, assignments=[(info, FitIns(round=1))], timeout=None
    )  # type: ignore[arg-type]
    [result] = outcome.results
    assert (
        without_timing(result.metrics) == {"loss": 1.0} and type(result.metrics["loss"]) is float
    )  # as protobuf hands it back (and the fit's time split, docs/monitoring.rst)
    assert torch.equal(result.state["w"], torch.full((2, 3), 2.0)) and result.state["w"].is_contiguous()
    assert outcome.bytes_up == sum(
        serde.wire_size(f)
        for f in serde.EncodedModel(result.state).frames(
            serde.StreamInfo(round=1, num_examples=3, metrics=result.metrics), chunk_size=fleet.chunk_size
        )
    )


def test_stream_wire_bytes_equals_the_frames():
    g = torch.Generator().manual_seed(0)
    states = [
        OrderedDict(),
        OrderedDict(a=torch.zeros(0)),
        OrderedDict(
            w=torch.randn(300, 7, generator=g),
            b=torch.randn(7, generator=g),
            s=torch.tensor(3),
            e=torch.zeros(0, 4),
        ),
        OrderedDict(
            x=torch.randn(1000, generator=g).to(torch.bfloat16),
            y=torch.randint(0, 5, (33,), generator=g),
            z=torch.ones(2, 2, dtype=torch.bool),
        ),
    ]
    infos = [
        serde.StreamInfo(),
        serde.StreamInfo(
            round=7,
            num_examples=123,
            metrics={"loss": 0.5},
            task_id="run-r7-fit",
            run_id="abc",
            client_id="c1",
        ),
        serde.StreamInfo(
            round=300,
            num_examples=2**40,
            metrics={f"m{i}": float(i) for i in range(10)},
            delta=True,
            version=5,
            base_version=4,
        ),
    ]
    for state in states:
        for info in infos:
            for chunk in (1, 7, 16, 100, 1 << 20):
                frames = serde.EncodedModel(state).frames(info, chunk_size=chunk)
                assert serde.stream_wire_bytes(state, info, chunk_size=chunk) == sum(
                    serde.wire_size(f) for f in frames
                ), (list(state), chunk)
    with pytest.raises(ValueError, match="chunk_size"):
        serde.stream_wire_bytes(states[2], infos[0], chunk_size=0)


@pytest.mark.parametrize("engine", ["sequential", "batched"])
def test_batched_outputs_reach_fedavg_as_rows_of_their_stacks(tmp_path, monkeypatch, engine):
    """Batched: each client's update is its rows of the chunk's stacks, uncopied by the fleet,
    and FedAvg averages every tensor in one reduction per stack. Sequential: copies, averaged
    update by update (the bit-exact path a deployment takes)."""
    import fedgrid.aggregation.fedavg as fedavg_mod

    taken = []
    real = fedavg_mod.weighted_mean_of_rows
    monkeypatch.setattr(
        fedavg_mod,
        "weighted_mean_of_rows",
        lambda *a, **k: taken.append(real(*a, **k) is not None) or real(*a, **k),
    )
    final, history = _run(tmp_path, True, monkeypatch, engine=engine, rounds=2)
    tensors = len(final)
    assert (
        len(taken) == 2 * tensors
        and all(taken) == (engine == "batched")
        and any(taken) == (engine == "batched")
    )
    assert [m.clients_ok for m in history] == [6, 6]
