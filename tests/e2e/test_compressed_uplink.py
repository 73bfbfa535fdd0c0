"""Compressed uplinks with error feedback: simulation and real gRPC end with the same bits."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from fedgrid.aggregation import FedAvg
from fedgrid.aggregation.selection import Sampling
from fedgrid.client import start_client as start  # harness.start_client starts a process
from fedgrid.compression.spec import CodecSpec
from fedgrid.fleet.codec_policy import CodecPolicy
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import Schedule
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.simulation.models import digits_mlp
from fedgrid.simulation.tasks import ClientOptions, builtin_client, initial_state

from harness import wait_until

CLIENTS, ROUNDS, SEED = 3, 3, 2


def _engine(fleet, rounds=ROUNDS):
    strategy = FedAvg(sampling=Sampling(seed=SEED, fit_config={"local_epochs": 1, "lr": 0.1}))
    strategy.initialize(initial_state=initial_state(digits_mlp, SEED))
    return RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=rounds,
            min_clients=CLIENTS,
            round_timeout=timedelta(seconds=120),
            join_timeout=timedelta(seconds=60),
            finish_timeout=timedelta(seconds=10),
        ),
    )


def _clients():
    return [builtin_client(i, CLIENTS, SEED, options=ClientOptions(device="cpu")) for i in range(CLIENTS)]


def _deploy(policy, downlink_codec=CodecSpec.NONE):
    """The same run over real gRPC, clients in threads of this process; returns the engine."""
    fleet = RemoteFleet(
        heartbeat_interval=timedelta(seconds=30), codec_policy=policy, downlink_codec=downlink_codec
    )
    server = Coordinator("127.0.0.1:0", fleet, max_workers=16).start()
    try:
        handles = [start(c, server.address, poll_wait_s=1.0) for c in _clients()]
        wait_until(lambda: len(fleet.live_clients()) == CLIENTS, timeout=60, what="clients to join")
        deployed = _engine(fleet)
        deployed.run()
        for h in handles:
            assert h.join(timeout=60).rounds == ROUNDS
    finally:
        server.stop(grace=0.5)
        fleet.close()
    return deployed


#: codec, error feedback, the least uplink ratio it reaches on the digits MLP
PARITY = [
    ("topk:0.01", "classic", 50),
    ("int8", "classic", 3.9),
    ("sparseloco", "momentum:0.9", 20),
    ("demo", "momentum:0.9", 20),
]


@pytest.mark.parametrize("codec,feedback,least_ratio", PARITY)
def test_simulation_and_grpc_agree_bit_for_bit(codec, feedback, least_ratio):
    policy = CodecPolicy(default=CodecSpec.parse(codec), error_feedback=feedback, feedback_reset_rounds=2)
    sim = _engine(InProcessFleet(_clients(), codec_policy=policy))
    sim_final = sim.run()
    deployed = _deploy(policy)
    final = deployed.strategy.global_state
    for name, tensor in sim_final.items():
        assert torch.equal(final[name], tensor), name
    for sim_m, m in zip(sim.history, deployed.history):
        ratio = m.extra["uplink_ratio"]
        assert ratio == pytest.approx(sim_m.extra["uplink_ratio"])
        assert ratio > least_ratio


def test_error_feedback_carries_what_topk_dropped():
    """Over rounds, a sparse uplink with error feedback moves the model as the dense one
    would, much more closely than the same codec without feedback (residual discarded)."""
    dense = _engine(InProcessFleet(_clients()), rounds=4).run()

    class NoFeedback(InProcessFleet):
        def _uplink(self, client_id, codec):
            encoder = super()._uplink(client_id, codec)
            encoder.feedback.reset()  # forget the residual every round
            return encoder

    classic = CodecPolicy(CodecSpec.parse("topk:0.1"), error_feedback="classic")
    with_ef = _engine(InProcessFleet(_clients(), codec_policy=classic), rounds=4).run()
    without = _engine(
        NoFeedback(_clients(), codec_policy=CodecPolicy(CodecSpec.parse("topk:0.1"))), rounds=4
    ).run()
    gap = lambda m: sum(float((m[k] - dense[k]).norm()) for k in dense)  # noqa: E731
    assert gap(with_ef) < 0.8 * gap(without)


def test_compressed_downlink_simulation_and_grpc_agree():
    policy = CodecPolicy(default=CodecSpec.parse("topk:0.05"))
    sim_fleet = InProcessFleet(_clients(), codec_policy=policy, downlink_codec=CodecSpec.parse("int8"))
    sim = _engine(sim_fleet)
    sim_final = sim.run()
    deployed = _deploy(policy, downlink_codec=CodecSpec.parse("int8"))
    final = deployed.strategy.global_state
    for name, tensor in sim_final.items():
        assert torch.equal(final[name], tensor), name
    for sim_m, m in zip(sim.history, deployed.history):
        assert m.bytes_down - sim_m.bytes_down <= 200 * CLIENTS  # same downloads, plus auth fields
    # Round 1 sends the whole model; later rounds only int8 differences (about 4x smaller).
    assert deployed.history[1].bytes_down < deployed.history[0].bytes_down / 3.5


def test_cli_simulate_and_coordinator_agree_with_topk(tmp_path):
    """`fedgrid simulate --codec topk:0.01` and a coordinator with client processes, same seed."""
    from fedgrid.config import load_config
    from fedgrid.runlog import load_model, read_metrics
    from fedgrid.simulation.run import run_simulation

    from harness import REFERENCE, start_client, start_coordinator

    flags = ["--rounds", "3", "--seed", str(SEED), "--codec", "topk:0.01"]
    proc, address = start_coordinator(tmp_path / "coord", *flags, "--min-clients", str(CLIENTS))
    clients = [
        start_client(address, tmp_path / f"c{i}.log", "--partition", f"{i}/{CLIENTS}", "--seed", str(SEED))
        for i in range(CLIENTS)
    ]
    try:
        for i, c in enumerate(clients):
            assert c.wait(timeout=180) == 0, (tmp_path / f"c{i}.log").read_text()[-2000:]
        assert proc.wait(timeout=60) == 0
    finally:
        for p in [proc, *clients]:
            if p.poll() is None:
                p.kill()
    reference, history = run_simulation(
        load_config(
            overrides={"rounds": 3, "clients": CLIENTS, "seed": SEED, "codec": "topk:0.01", **REFERENCE}
        )
    )
    deployed = load_model(tmp_path / "coord" / "model.safetensors")
    for name, tensor in reference.items():
        assert torch.equal(deployed[name], tensor), name
    metrics = read_metrics(tmp_path / "coord")
    assert all(m["uplink_ratio"] > 50 for m in metrics)
    assert [round(m["uplink_ratio"], 6) for m in metrics] == [
        round(m.extra["uplink_ratio"], 6) for m in history
    ]
