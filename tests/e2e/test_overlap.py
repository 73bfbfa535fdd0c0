"""Overlapped outer syncs (issue 25, item 1): a worker's inner steps go on while its upload
crosses a slow link, and overlapped streaming DiLoCo deployed over real processes, through
a lossy uplink codec, equals its simulation bit for bit."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import OrderedDict
from datetime import timedelta

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid.client import start_client
from fedgrid.client.connection import Connection
from fedgrid.client.torch_client import TorchClient
from fedgrid.config import load_config
from fedgrid.ops.wan import WanLink, WanRelay
from fedgrid.runlog import load_model, read_metrics
from fedgrid.simulation.run import run_simulation
from fedgrid.types import FitIns

from harness import REFERENCE, InProcessCoordinator, child_env, start_coordinator
from harness import start_client as start_client_process

#: The link of the order test: 1 Mbit/s, so the 100 kB upload takes about 0.8 s.
LINK = WanLink(delay_ms=20, rate_mbit=1.0)
#: Seconds each inner step of the order test takes: a stand-in for a real step's compute,
#: so the lookahead outlasts the upload's start on any machine.
STEP_S = 0.05


class _Logged(torch.optim.AdamW):
    """The inner optimizer of the order test: logs each step of the lookahead."""

    def __init__(self, params, log: list[str]) -> None:
        super().__init__(params)
        self.log, self.count = log, 0

    def step(self, closure=None):  # type: ignore[override]
        if threading.current_thread().name.startswith("fedgrid-lookahead"):
            self.count += 1
            self.log.append(f"lookahead step {self.count}")
        return super().step(closure)


class _Slow(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(STEP_S)  # the compute of a real model's step (see STEP_S); not a synchronization
        return super().forward(x)


def test_inner_steps_continue_while_the_upload_crosses_a_slow_link(monkeypatch):
    log: list[str] = []  # one ordered log; list.append is atomic
    upload = Connection.upload

    def logged_upload(self, *args, **kwargs):
        log.append("upload started")
        try:
            return upload(self, *args, **kwargs)
        finally:
            log.append("upload finished")

    monkeypatch.setattr(Connection, "upload", logged_upload)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 64, generator=g), torch.randint(0, 400, (40,), generator=g))
    client = TorchClient(
        _Slow(64, 400),  # 26,000 parameters: a 104 kB upload
        DataLoader(data, batch_size=10),
        nn.functional.cross_entropy,
        lambda params: torch.optim.SGD(params, lr=0.1),
        inner_optimizer=lambda params: _Logged(params, log),
        device="cpu",
        name="far",
    )
    state = OrderedDict((k, v.detach().clone()) for k, v in client.model.state_dict().items())
    tau = 20  # 1 s of lookahead, against about 0.8 s of upload
    ins = FitIns(
        round=1,
        config={"algorithm": "diloco", "inner_steps": tau, "sync_delay_steps": tau, "merge_alpha": 0.5},
    )
    server = InProcessCoordinator(state)
    try:
        with WanRelay(server.address, LINK) as relay:
            handle = start_client(client, relay.address, poll_wait_s=1.0)
            infos = server.fleet.wait_for_clients(min_clients=1, timeout=timedelta(seconds=30))
            outcome = server.fleet.fit_round(
                server_round=1,
                global_state=state,
                assignments=[(infos[0], ins)],
                timeout=timedelta(seconds=60),
            )
            assert [r.client.name for r in outcome.results] == ["far"]
            server.fleet.finish(timeout=timedelta(seconds=30))
            handle.join(timeout=30)
        client.wait_lookahead()
    finally:
        server.stop()
    start, end = log.index("upload started"), log.index("upload finished")
    during = [e for e in log[start:end] if e.startswith("lookahead step")]
    assert during, log  # steps ran between the upload's start and its end
    assert log.count("upload started") == 1 and client.inner_optimizer.count == tau
    assert outcome.results[0].num_examples == 40
    assert relay.bytes_up > 104_000  # the whole update crossed the link


ROUNDS, CLIENTS, SEED = 3, 2, 5
OVERLAP = {
    "strategy": "streaming-diloco",
    "num_fragments": 2,
    "inner_steps": 6,
    "sync_delay_steps": 2,
    "inner_lr": 0.01,
    "codec": "fp4",  # an outer-gradient codec, with error feedback with momentum
    "error_feedback": "momentum:0.9",
}


def test_overlapped_streaming_diloco_deployment_equals_simulation_through_a_lossy_codec(tmp_path):
    run_dir = tmp_path / "coord"
    flags = [x for k, v in OVERLAP.items() for x in ("--" + k.replace("_", "-"), str(v))]
    proc, address = start_coordinator(
        run_dir,
        "--rounds",
        str(ROUNDS),
        "--seed",
        str(SEED),
        "--min-clients",
        str(CLIENTS),
        "--heartbeat-interval-s",
        "1",
        *flags,
    )
    clients = [
        start_client_process(
            address, tmp_path / f"client{i}.log", "--partition", f"{i}/{CLIENTS}", "--seed", str(SEED)
        )
        for i in range(CLIENTS)
    ]
    try:
        for i, c in enumerate(clients):
            assert c.wait(timeout=180) == 0, (tmp_path / f"client{i}.log").read_text()[-3000:]
        assert proc.wait(timeout=60) == 0
    finally:
        for p in [proc, *clients]:
            if p.poll() is None:
                p.kill()
    metrics = read_metrics(run_dir)
    assert [m["clients_ok"] for m in metrics] == [CLIENTS] * ROUNDS
    sim_state, sim_history = run_simulation(
        load_config(
            overrides={
                "rounds": ROUNDS,
                "clients": CLIENTS,
                "seed": SEED,
                "out": str(tmp_path / "sim"),
                **OVERLAP,
                **REFERENCE,
            }
        )
    )
    deployed = load_model(run_dir / "model.safetensors")
    for name, tensor in sim_state.items():
        assert torch.equal(deployed[name], tensor), name  # same engine, same threads, same tau: the same bits
    assert [m.loss for m in sim_history] == [m["loss"] for m in metrics]
    assert metrics[-1]["loss"] < metrics[0]["loss"]  # fp4 with error feedback, tau = 2: it trains


EXIT_SCRIPT = """
import time, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from fedgrid.client.torch_client import TorchClient
from fedgrid.types import FitIns

class Slow(nn.Linear):
    delay = 0.0

    def forward(self, x):
        time.sleep(self.delay)  # a step's compute: once set, the 200 steps after the upload take 50 s
        return super().forward(x)

data = TensorDataset(torch.randn(20, 4), torch.randint(0, 3, (20,)))
client = TorchClient(Slow(4, 3), DataLoader(data, batch_size=10), nn.functional.cross_entropy,
                     lambda p: torch.optim.SGD(p, lr=0.1), device="cpu", name="leaving")
state = {k: v.clone() for k, v in client.model.state_dict().items()}
config = {"algorithm": "diloco", "inner_steps": 200, "sync_delay_steps": 200}
client.fit(state, FitIns(round=1, config=config))
Slow.delay = 0.25
print("fit returned, the lookahead runs", flush=True)
"""


def test_a_process_exits_cleanly_while_a_lookahead_runs():
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, env=child_env(), timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fit returned" in done.stdout and "Traceback" not in done.stderr
    assert time.monotonic() - began < 45  # it did not wait out the lookahead's 50 s
