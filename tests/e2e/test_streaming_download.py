"""Streaming DiLoCo downloads only the fragments a worker merges (``FitIns.download``).

On digits (the 64-64-10 MLP, 4,810 float32 parameters) with F = 3 fragments of 1,600, 1,600
and 1,610 parameters (the first layer's weight is 85% of the model, so its rows are split:
rows 0:25, rows 25:50, then rows 50:64 with the rest; ``blocks.default_blocks``): from round 2 on a worker that trained last round downloads one fragment,
and the run ends with exactly the model of the same run with whole-model downloads; over
real gRPC processes it ends with the simulation's model; a worker that missed rounds gets
the fragments it missed, one away for F rounds or restarted without its replica the whole
model.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from datetime import timedelta

import pytest
import torch

from fedgrid.aggregation import StreamingDiLoCo
from fedgrid.aggregation.updates import as_model
from fedgrid.client import Client
from fedgrid.client.runtime import Connection
from fedgrid.compression.spec import CodecSpec
from fedgrid.config import load_config
from fedgrid.fleet.codec_policy import CodecPolicy
from fedgrid.proto import serde
from fedgrid.runlog import load_model, read_metrics
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.server.strategies import build_strategy
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.simulation.run import run_simulation
from fedgrid.simulation.tasks import client_options, resolve
from fedgrid.types import FitIns, TensorSpec

from harness import REFERENCE, start_client, start_coordinator, wait_until
from harness_clients import Named

F, SEED = 3, 0
OPTIONS = {
    "strategy": "streaming-diloco",
    "num_fragments": F,
    "inner_steps": 20,
    "inner_lr": 0.01,
    "seed": SEED,
}
MODEL_BYTES = 4 * 4810
FRAMING = 60 + 40 * 6  # stream header, plus the metadata of each tensor (6 on the wire: 3 row slices)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _whole_model_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Streaming DiLoCo as before ``FitIns.download``: every task downloads the whole model."""
    configure = StreamingDiLoCo.configure_round

    def whole(self, **kwargs):
        return [
            (client, dataclasses.replace(ins, download=None)) for client, ins in configure(self, **kwargs)
        ]

    monkeypatch.setattr(StreamingDiLoCo, "configure_round", whole)


def _fragment_bytes(strategy: StreamingDiLoCo, index: int) -> int:
    specs = strategy.downlink_state(server_round=1)  # the model with its row slices
    return sum(specs[n].numel() * specs[n].element_size() for n in strategy.fragments[index].names)


def test_simulation_downloads_one_fragment_per_round_and_ends_bit_identical(monkeypatch):
    rounds, clients = 7, 4
    config = load_config(overrides={**OPTIONS, "rounds": rounds, "clients": clients})
    state, history = run_simulation(config)
    strategy = build_strategy(config, num_clients=clients)
    strategy.initialize(initial_state=state)
    assert isinstance(strategy, StreamingDiLoCo)
    sizes = [_fragment_bytes(strategy, i) for i in range(F)]
    assert sizes == [4 * 1600, 4 * 1600, 4 * 1610]

    with monkeypatch.context() as patch:
        _whole_model_downloads(patch)
        reference, before = run_simulation(config)
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name  # the same bits: only the bytes changed

    assert all(m.clients_ok == clients and m.clients_failed == 0 for m in history)
    assert history[-1].accuracy is not None and history[-1].accuracy > 0.85  # 0.930 observed
    for m in before:  # the whole model every round: 19,240 bytes + framing per client
        assert MODEL_BYTES < m.bytes_down / clients <= MODEL_BYTES + FRAMING
    assert (
        MODEL_BYTES < history[0].bytes_down / clients <= MODEL_BYTES + FRAMING
    )  # round 1: everyone needs it all
    for m in history[1:]:  # the fragment synced last round, alone
        fragment = sizes[(m.round - 1) % F]
        assert fragment < m.bytes_down / clients <= fragment + FRAMING, (m.round, m.bytes_down)
        assert m.bytes_down / clients <= max(sizes) + FRAMING
        assert m.bytes_up == history[m.round - 1].bytes_up and m.bytes_up == before[m.round - 1].bytes_up
    # Rounds 2 to 7 sync each fragment twice: 2 models' worth of downloads instead of 6.
    after = sum(m.bytes_down for m in history[1:]) / clients
    whole = sum(m.bytes_down for m in before[1:]) / clients
    assert 2 * MODEL_BYTES < after <= 2 * MODEL_BYTES + 6 * FRAMING
    assert after < whole / 2.9


@pytest.mark.parametrize(
    "codecs",
    [{"codec": "int8"}, {"downlink_codec": "int8"}, {"downlink_codec": "none+zstd"}],
    ids=lambda c: str(c),
)
def test_other_codecs(codecs, monkeypatch):
    """A lossy uplink sends differences against the global values of the uploaded fragment:
    those are downloaded too. A lossy downlink keeps one shadow for every client: downloads
    are what they were. A lossless compressed downlink sends the fragment, compressed.
    Each run ends with the bits of its whole-model-download twin."""
    rounds, clients = 4, 2
    config = load_config(overrides={**OPTIONS, **codecs, "rounds": rounds, "clients": clients})
    state, history = run_simulation(config)
    with monkeypatch.context() as patch:
        _whole_model_downloads(patch)
        reference, before = run_simulation(config)
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name
    assert [m.clients_ok for m in history] == [clients] * rounds
    strategy = build_strategy(config, num_clients=clients)
    strategy.initialize(initial_state=state)
    assert isinstance(strategy, StreamingDiLoCo)
    for m, was in zip(history[1:], before[1:]):
        merged, uploaded = (m.round - 1) % F, m.round % F
        if codecs.get("downlink_codec") == "int8":
            assert m.bytes_down == was.bytes_down
        elif "codec" in codecs:  # exact downlink, lossy uplink: the merged and the uploaded fragment
            wanted = _fragment_bytes(strategy, merged) + _fragment_bytes(strategy, uploaded)
            assert wanted < m.bytes_down / clients <= wanted + FRAMING
        else:
            assert (
                m.bytes_down / clients
                <= _fragment_bytes(strategy, merged) + FRAMING
                < was.bytes_down / clients
            )


def test_coordinator_and_client_processes_match_simulation(tmp_path):
    rounds, clients = 4, 3
    run_dir = tmp_path / "coord"
    proc, address = start_coordinator(
        run_dir,
        "--strategy",
        "streaming-diloco",
        "--num-fragments",
        str(F),
        "--inner-steps",
        "20",
        "--inner-lr",
        "0.01",
        "--rounds",
        str(rounds),
        "--min-clients",
        str(clients),
        "--seed",
        str(SEED),
        "--heartbeat-interval-s",
        "1",
    )
    procs = [
        start_client(
            address, tmp_path / f"client{i}.log", "--partition", f"{i}/{clients}", "--seed", str(SEED)
        )
        for i in range(clients)
    ]
    try:
        for i, c in enumerate(procs):
            assert c.wait(timeout=240) == 0, (tmp_path / f"client{i}.log").read_text()[-3000:]
        assert proc.wait(timeout=60) == 0
    finally:
        for p in [proc, *procs]:
            if p.poll() is None:
                p.kill()
    metrics = read_metrics(run_dir)
    assert [m["clients_ok"] for m in metrics] == [clients] * rounds

    sim_state, sim_history = run_simulation(
        load_config(overrides={**OPTIONS, "rounds": rounds, "clients": clients, **REFERENCE})
    )
    deployed = load_model(run_dir / "model.safetensors")
    assert set(deployed) == set(sim_state)
    for name, tensor in sim_state.items():
        assert torch.equal(deployed[name], tensor), name  # same engine, same threads: the same bits
    # The same streams as in simulation; deployment's headers also carry run and task ids.
    for sim_m, m in zip(sim_history, metrics):
        assert 0 <= m["bytes_down"] - sim_m.bytes_down <= 200 * clients, (
            m["round"],
            m["bytes_down"],
            sim_m.bytes_down,
        )
    assert metrics[0]["bytes_down"] > clients * MODEL_BYTES
    assert metrics[1]["bytes_down"] < clients * (
        4 * 1600 + FRAMING + 200
    )  # round 2: fragment 1 (1,600 parameters)
    assert metrics[3]["bytes_down"] < clients * (4 * 1600 + FRAMING + 200) < clients * MODEL_BYTES


class Recording(Client):
    """A client that records the tensors each of its tasks downloaded."""

    def __init__(self, inner: Client) -> None:
        self.inner, self.name, self.region = inner, inner.name, inner.region
        self.received: dict[int, set[str]] = {}

    @property
    def num_examples(self) -> int:
        return self.inner.num_examples

    def fit(self, state, ins):
        self.received[ins.round] = set(state)
        return self.inner.fit(state, ins)


def _stream_bytes(state, names) -> int:
    part = OrderedDict((n, t) for n, t in state.items() if n in names)
    return sum(serde.wire_size(c) for c in serde.EncodedModel(part).frames(serde.StreamInfo(round=1)))


def test_missed_rounds_and_a_lost_replica():
    """Three workers, F = 3. w1 misses round 3; w2 restarts without its state before round 5;
    w0 is away for rounds 5 to 7 (F rounds)."""
    config = load_config(overrides={**OPTIONS, "rounds": 8, "clients": 3, "inner_steps": 5})
    resolved = resolve(dataset=config.dataset, seed=SEED)
    make = lambda i: resolved.client_factory(i, 3, SEED, client_options(config))  # noqa: E731
    workers = [Recording(make(i)) for i in range(3)]
    fleet = InProcessFleet(workers)
    strategy = build_strategy(config, num_clients=3)
    strategy.initialize(initial_state=resolved.initial_state)
    assert isinstance(strategy, StreamingDiLoCo)
    infos = fleet.wait_for_clients(min_clients=3, timeout=timedelta(seconds=1))
    absent = {3: {1}, 5: {0}, 6: {0}, 7: {0}}
    model = set(strategy.downlink_state(server_round=1))  # the whole model, its row slices by name
    fragments = [set(f.names) for f in strategy.fragments]
    outcomes = {}
    for server_round in range(1, 9):
        if server_round == 5:
            workers[2].inner = make(2)  # a fresh process, no saved state: no replica
        live = [info for i, info in enumerate(infos) if i not in absent.get(server_round, set())]
        pairs = strategy.configure_round(server_round=server_round, clients=live)
        sent = strategy.downlink_state(server_round=server_round)
        outcome = fleet.fit_round(
            server_round=server_round, global_state=sent, assignments=pairs, timeout=timedelta(seconds=60)
        )
        # Every client's download counted as what was sent to it.
        assert outcome.bytes_down == sum(_stream_bytes(sent, ins.download or sent) for _, ins in pairs)
        strategy.aggregate(server_round=server_round, results=outcome.results, failures=outcome.failures)
        outcomes[server_round] = outcome

    w0, w1, w2 = (w.received for w in workers)
    assert w0[1] == w1[1] == w2[1] == model
    assert w0[4] == w2[4] == fragments[0]  # synced in round 3
    assert w1[4] == fragments[2] | fragments[0]  # missed round 3: the fragments of rounds 2 and 3
    # w2, restarted without its replica, is sent fragment 1 in round 5, fails with the reason, then gets it all.
    assert w2[5] == fragments[1]
    assert [f.client.name for f in outcomes[5].failures] == [workers[2].name]
    assert "keeps no replica" in outcomes[5].failures[0].reason
    assert w2[6] == model and w1[6] == fragments[2]
    assert {r.client.name for r in outcomes[6].results} == {workers[1].name, workers[2].name}
    assert w0[8] == model  # away for rounds 5 to 7: every fragment changed
    assert w1[8] == w2[8] == fragments[1]
    assert [len(outcomes[r].results) for r in range(1, 9)] == [3, 3, 2, 3, 1, 2, 2, 3]


@pytest.mark.parametrize("uplink,downlink", [("none", "none"), ("int8", "none"), ("none", "int8")])
def test_grpc_fleet_sends_each_client_what_its_task_names(uplink, downlink):
    """Over a real gRPC server and the client runtime: c0's task downloads tensor ``a`` (plus
    ``c``, the tensor it uploads, when its uplink sends differences), c1's the whole model (a
    lossy downlink sends both the whole shadow); every upload is reconstructed right."""
    g = torch.Generator().manual_seed(3)
    model = OrderedDict(
        a=torch.randn(30, 4, generator=g),
        b=torch.randn(4, generator=g),
        c=torch.randn(6, generator=g),
        n=torch.tensor(3),
    )
    fleet = RemoteFleet(
        heartbeat_interval=timedelta(seconds=60),
        codec_policy=CodecPolicy(default=CodecSpec.parse(uplink)),
        downlink_codec=CodecSpec.parse(downlink),
    )
    server = Coordinator("127.0.0.1:0", fleet, max_workers=8).start()
    conns = [Connection(server.address) for _ in range(2)]
    try:
        for i, conn in enumerate(conns):
            conn.join(Named(f"c{i}"))
        infos = {info.name: info for info in fleet.live_clients()}
        expected = OrderedDict(c=TensorSpec.of(model)["c"])
        assignments = [
            (infos["c0"], FitIns(round=1, expected=expected, download=("a",))),
            (infos["c1"], FitIns(round=1, expected=expected)),
        ]
        out: list = []
        thread = threading.Thread(
            target=lambda: out.append(
                fleet.fit_round(
                    server_round=1, global_state=model, assignments=assignments, timeout=timedelta(seconds=60)
                )
            )
        )
        thread.start()
        wait_until(lambda: fleet.current_round is not None, timeout=10, what="round to open")
        sizes = 0
        for i, conn in enumerate(conns):
            task = conn.poll(5).task
            held = conn.fetch_model(task.task_id)
            wanted = {"a", "c"} if uplink != "none" else {"a"}
            assert set(held) == (wanted if i == 0 and downlink == "none" else set(model)), i
            for name, tensor in held.items():  # the first round of a lossy downlink is exact too
                assert torch.equal(tensor, model[name]), (i, name)
            part = OrderedDict((n, t) for n, t in model.items() if n in held)
            header = serde.StreamInfo(
                run_id=fleet.run_id,
                task_id=task.task_id,
                round=1,
                version=fleet.current_round.downlink.version,
            )
            sizes += sum(serde.wire_size(f) for f in serde.EncodedModel(part).frames(header))
            conn.upload(
                task.task_id,
                1,
                OrderedDict(c=held["c"] + 1.0 if "c" in held else model["c"] + 1.0),
                1,
                {},
                codec=CodecSpec.parse(uplink),
                global_state=held,
            )
        thread.join(timeout=30)
        outcome = out[0]
        assert len(outcome.results) == 2 and not outcome.failures
        for result in outcome.results:  # a lossy uplink's result holds the difference (FitRes.delta)
            got = as_model(model, result).state["c"]
            torch.testing.assert_close(got, model["c"] + 1.0, atol=0.05 if uplink != "none" else 0, rtol=0)
        if downlink == "none":
            assert outcome.bytes_down == sizes  # what was sent, counted
    finally:
        for conn in conns:
            conn.close()
        server.stop(grace=0.5)
        fleet.close()
