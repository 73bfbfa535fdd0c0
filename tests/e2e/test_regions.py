"""Regions: ``fedgrid region`` coordinates its clients and joins the global coordinator as one client.

With H = 1 regional round per global round and lossless links, a hierarchy of two regions
of two clients each is flat FedAvg over the four clients (a weighted mean of weighted means),
up to float rounding; its bytes are counted per link (LAN in each region's run directory,
WAN in the global one, per region).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from fedgrid.config import load_config
from fedgrid.events import read_events
from fedgrid.runlog import load_model, read_metrics
from fedgrid.simulation.run import run_simulation

import zygote
from harness import FEDGRID, REFERENCE, THREADS, child_env, start_client, start_coordinator, wait_until

ROUNDS, SEED = 2, 3
#: A weighted mean of weighted means against one weighted mean, in float32 tensors summed in float64.
TOLERANCE = 1e-6


def _wait_all(
    procs: list[subprocess.Popen], logs: Path, *, timeout: float, skip: tuple[subprocess.Popen, ...] = ()
) -> None:
    """Every process but ``skip`` exits 0 (the last started first); else the logs' tails say why."""
    for proc in procs[::-1]:
        if proc not in skip:
            assert proc.wait(timeout=timeout) == 0, [
                p.read_text()[-3000:] for p in sorted(logs.glob("*.log"))
            ]


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()


def start_region(out: Path, upstream: str, name: str, *args: str) -> tuple[subprocess.Popen, str]:
    """``fedgrid region`` on port 0; returns it with its address (``RUN_DIR/address``)."""
    log = open(out.parent / f"{out.name}.log", "w")
    proc = zygote.popen(
        [
            *FEDGRID,
            "region",
            "--upstream",
            upstream,
            "--name",
            name,
            "--listen",
            "127.0.0.1:0",
            "--out",
            str(out),
            "--threads",
            str(THREADS),
            "--seed",
            str(SEED),
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=child_env(),
    )
    address = out / "address"
    wait_until(
        lambda: address.exists() and address.read_text().strip() != "" or proc.poll() is not None,
        timeout=60,
        what=f"region {name}'s address",
    )
    assert proc.poll() is None, (out.parent / f"{out.name}.log").read_text()
    return proc, address.read_text().strip()


def test_two_regions_with_one_regional_round_are_flat_fedavg(tmp_path):
    top = tmp_path / "global"
    coordinator, address = start_coordinator(
        top, "--rounds", str(ROUNDS), "--min-clients", "2", "--seed", str(SEED)
    )
    procs = [coordinator]
    try:
        for r, name in enumerate(("region-a", "region-b")):
            region, region_address = start_region(
                tmp_path / name, address, name, "--min-clients", "2", "--regional-rounds", "1"
            )
            procs.append(region)
            for i in (2 * r, 2 * r + 1):
                procs.append(
                    start_client(
                        region_address,
                        tmp_path / f"client{i}.log",
                        "--partition",
                        f"{i}/4",
                        "--seed",
                        str(SEED),
                    )
                )
        _wait_all(procs, tmp_path, timeout=240)
    finally:
        _kill_all(procs)

    flat, _ = run_simulation(
        load_config(
            overrides={
                "rounds": ROUNDS,
                "clients": 4,
                "seed": SEED,
                "out": str(tmp_path / "flat"),
                **REFERENCE,
            }
        )
    )
    hierarchical = load_model(top / "model.safetensors")
    for name, tensor in flat.items():
        torch.testing.assert_close(hierarchical[name], tensor, atol=TOLERANCE, rtol=0)

    top_metrics = read_metrics(top)
    assert [m["clients_ok"] for m in top_metrics] == [2, 2] and [m["examples"] for m in top_metrics][0] > 0
    for name in ("region-a", "region-b"):
        lan = read_metrics(tmp_path / name)
        assert [m["round"] for m in lan] == [1, 2] and all(m["clients_ok"] == 2 for m in lan)
        wan = [json.loads(line) for line in (tmp_path / name / "wan.jsonl").read_text().splitlines()]
        assert [w["round"] for w in wan] == [1, 2]
        for g, w, m in zip(top_metrics, wan, lan):
            # Each tier counts its own links: the global coordinator a region's WAN bytes, the region its LAN's.
            assert (
                abs(w["bytes_up"] - g[f"bytes_up.{name}"]) <= 400
                and abs(g[f"bytes_down.{name}"] - w["bytes_down"]) <= 400
            )
            assert (
                m["bytes_up"] > 1.9 * g[f"bytes_up.{name}"]
            )  # two clients' updates in, one regional model out
            # A region is one learner upstream whose seconds are its workers': its utilization
            # at the top is its LAN round's (H = 1), the ratio of its workers' sums.
            assert g[f"utilization.{name}"] == pytest.approx(m["compute_s"] / m["worker_wall_s"])
            assert 0 < m["utilization"] < 1 and m["comm_s"] > 0
        assert g[f"bytes_up.{name}"] > 4 * 4000
    lans = [read_metrics(tmp_path / name) for name in ("region-a", "region-b")]
    for g, a, b in zip(top_metrics, *lans):
        for key in ("compute_s", "comm_s", "wait_s", "worker_wall_s"):  # sums over the regions' workers
            assert g[key] == pytest.approx(a[key] + b[key])
        assert g["utilization"] == pytest.approx((a["compute_s"] + b["compute_s"]) / g["worker_wall_s"])


def _start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return zygote.popen(command, stdout=open(log, "a"), stderr=subprocess.STDOUT, env={**child_env(), **env})


def test_a_region_killed_mid_round_rejoins_that_round_from_its_state(tmp_path, monkeypatch):
    """slow_app's client i sends ``global + (i + 1)`` weighted by ``i + 1``: a region of clients
    0 and 1 moves its model by 5/3 a regional round, one of clients 2 and 3 by 25/7. With H = 2,
    a global round of both regions (weights 3 and 7) moves the model by exactly 6, one of
    region-a alone by 10/3: the final model says which updates counted, and how often.

    region-b is killed in its second regional round of global round 2 (its first is committed)
    and restarted at once: it rejoins global round 2 (the coordinator hands its open task to the
    new session), goes back to its state after global round 1 and runs regional rounds 3 and 4
    again, so every global round counts both regions once and its rounds run 1 to 8, each once:
    the uninterrupted run's model and numbers."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "support" / "apps"))
    from fedgrid.plugins import model_state

    markers = tmp_path / "markers"
    markers.mkdir()
    env = {"SLOW_APP_MARKER_DIR": str(markers), "SLOW_APP_FIT_S": "0.3", "FEDGRID_RETRY_MAX_WAIT_S": "1"}
    top = tmp_path / "global"
    coordinator, address = start_coordinator(
        top,
        "--model",
        "slow_app:model",
        "--rounds",
        "4",
        "--min-clients",
        "2",
        "--seed",
        str(SEED),
        # A region restarted within 3 heartbeats is still in its round (and after that, rejoins it
        # as long as the round is open: region-a's result alone does not close it).
        "--heartbeat-interval-s",
        "10",
        "--round-timeout-s",
        "120",
    )
    procs = [coordinator]
    region_args = [
        "--min-clients",
        "2",
        "--regional-rounds",
        "2",
        "--heartbeat-interval-s",
        "1",
        "--round-timeout-s",
        "60",
    ]

    def region_command(name: str, listen: str) -> list[str]:
        return [
            *FEDGRID,
            "region",
            "--upstream",
            address,
            "--name",
            name,
            "--listen",
            listen,
            "--out",
            str(tmp_path / name),
            "--state-dir",
            str(tmp_path / f"{name}-state"),
            "--threads",
            str(THREADS),
            "--seed",
            str(SEED),
            *region_args,
        ]

    try:
        regions = {}
        for r, name in enumerate(("region-a", "region-b")):
            regions[name] = _start(region_command(name, "127.0.0.1:0"), tmp_path / f"{name}.log", env)
            procs.append(regions[name])
            path = tmp_path / name / "address"
            wait_until(
                lambda: path.exists() and path.read_text().strip() != "", timeout=60, what=f"{name}'s address"
            )
            for i in (2 * r, 2 * r + 1):
                procs.append(
                    _start(
                        [
                            *FEDGRID,
                            "client",
                            "--coordinator",
                            path.read_text().strip(),
                            "--app",
                            "slow_app:client",
                            "--partition",
                            f"{i}/4",
                            "--threads",
                            str(THREADS),
                        ],
                        tmp_path / f"client{i}.log",
                        env,
                    )
                )
        b_address = (tmp_path / "region-b" / "address").read_text().strip()
        # Regional round 4 is global round 2's second: kill region-b while client 2 trains it.
        wait_until(
            (markers / "fit-2-4").exists, timeout=180, what="region-b's clients to train global round 2"
        )
        regions["region-b"].kill()
        regions["region-b"].wait(timeout=30)
        restarted = _start(
            region_command("region-b", b_address), tmp_path / "region-b.log", env
        )  # same port: its clients retry it
        procs.append(restarted)
        _wait_all(procs, tmp_path, timeout=240, skip=(regions["region-b"],))
    finally:
        _kill_all(procs)

    rounds = read_metrics(top)
    assert [m["round"] for m in rounds] == [1, 2, 3, 4]
    assert [(m["clients_ok"], m["clients_failed"]) for m in rounds] == [(2, 0)] * 4
    assert [m["examples"] for m in rounds] == [10, 10, 10, 10]
    final, initial = load_model(top / "model.safetensors"), model_state("slow_app:model", seed=SEED)
    for name, tensor in initial.items():  # both regions once in every round: the uninterrupted model
        torch.testing.assert_close(final[name], tensor + 24.0, atol=1e-4, rtol=0)
    assert "resumed" in (tmp_path / "region-b.log").read_text()
    handed = [e for e in read_events(top / "events.jsonl") if e.event == "task_handed_over"]
    assert [(e["round"], e["name"]) for e in handed] == [(2, "region-b")]
    assert [m["round"] for m in read_metrics(tmp_path / "region-b")] == list(range(1, 9))


def test_a_deployed_hierarchy_equals_fedgrid_simulate_with_the_same_hierarchy(tmp_path):
    from fedgrid.simulation.heterogeneity import ClientProfiles

    regions, h = "region-a:0.5,region-b:0.5", 2
    profiles = ClientProfiles(4, seed=SEED, regions=regions)
    top = tmp_path / "global"
    coordinator, address = start_coordinator(
        top, "--rounds", str(ROUNDS), "--min-clients", "2", "--seed", str(SEED)
    )
    procs = [coordinator]
    try:
        for name in ("region-a", "region-b"):
            region, region_address = start_region(
                tmp_path / name, address, name, "--min-clients", "2", "--regional-rounds", str(h)
            )
            procs.append(region)
            for i in (
                i for i in range(4) if profiles.region(i) == name
            ):  # the simulation's deal of clients to regions
                procs.append(
                    start_client(
                        region_address,
                        tmp_path / f"client{i}.log",
                        "--partition",
                        f"{i}/4",
                        "--seed",
                        str(SEED),
                    )
                )
        _wait_all(procs, tmp_path, timeout=240)
    finally:
        _kill_all(procs)
    config = load_config(
        overrides={
            "rounds": ROUNDS,
            "clients": 4,
            "seed": SEED,
            "regions": regions,
            "hierarchy": True,
            "regional_rounds": h,
            "out": str(tmp_path / "sim"),
            **REFERENCE,
        }
    )
    simulated, history = run_simulation(config)
    deployed = load_model(top / "model.safetensors")
    for name, tensor in simulated.items():
        assert torch.equal(deployed[name], tensor), name  # the same program, the same order: the same bits
    deployed_metrics = read_metrics(top)
    for sim_m, m in zip(history, deployed_metrics):
        assert sim_m.extra["examples"] == m["examples"] and sim_m.clients_ok == m["clients_ok"] == 2
        for name in ("region-a", "region-b"):  # LAN bytes as the regions reported them, H rounds each
            assert abs(sim_m.extra[f"lan_bytes_up.{name}"] - m[f"lan_bytes_up.{name}"]) <= 200 * h * 2
            assert sim_m.extra[f"lan_bytes_up.{name}"] > h * 1.9 * sim_m.extra[f"bytes_up.{name}"]


def test_a_region_that_loses_its_upstream_keeps_its_clients_and_joins_again(tmp_path, monkeypatch):
    """The global coordinator dies after round 1 and comes back from its state directory on its
    port: each region keeps its clients joined and retries with its session until the global
    coordinator answers again, and the run completes with the same region and client
    processes; every global round counts both regions once (slow_app: +6 a round, see above)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "support" / "apps"))
    from fedgrid.plugins import model_state

    markers = tmp_path / "markers"
    markers.mkdir()
    client_env = {
        "SLOW_APP_MARKER_DIR": str(markers),
        "SLOW_APP_FIT_S": "0.2",
        "FEDGRID_RETRY_MAX_WAIT_S": "1",
    }
    region_env = client_env
    top, state = tmp_path / "global", tmp_path / "global-state"
    global_args = [
        "--model",
        "slow_app:model",
        "--rounds",
        "3",
        "--min-clients",
        "2",
        "--seed",
        str(SEED),
        "--heartbeat-interval-s",
        "1",
        "--round-timeout-s",
        "120",
        "--state-dir",
        str(state),
    ]
    coordinator, address = start_coordinator(top, *global_args)
    procs, clients = [coordinator], []
    try:
        for r, name in enumerate(("region-a", "region-b")):
            procs.append(
                _start(
                    [
                        *FEDGRID,
                        "region",
                        "--upstream",
                        address,
                        "--name",
                        name,
                        "--listen",
                        "127.0.0.1:0",
                        "--out",
                        str(tmp_path / name),
                        "--threads",
                        str(THREADS),
                        "--seed",
                        str(SEED),
                        "--min-clients",
                        "2",
                        "--regional-rounds",
                        "2",
                        "--heartbeat-interval-s",
                        "1",
                    ],
                    tmp_path / f"{name}.log",
                    region_env,
                )
            )
            path = tmp_path / name / "address"
            wait_until(
                lambda: path.exists() and path.read_text().strip() != "", timeout=60, what=f"{name}'s address"
            )
            for i in (2 * r, 2 * r + 1):
                clients.append(
                    _start(
                        [
                            *FEDGRID,
                            "client",
                            "--coordinator",
                            path.read_text().strip(),
                            "--app",
                            "slow_app:client",
                            "--partition",
                            f"{i}/4",
                            "--threads",
                            str(THREADS),
                        ],
                        tmp_path / f"client{i}.log",
                        client_env,
                    )
                )
        procs += clients
        wait_until(
            lambda: (top / "metrics.jsonl").exists() and len(read_metrics(top)) >= 1,
            timeout=180,
            what="global round 1",
        )
        coordinator.kill()
        coordinator.wait(timeout=30)
        assert all(p.poll() is None for p in procs[1:])  # the regions and their clients stay
        restarted = zygote.popen(
            [
                *FEDGRID,
                "coordinator",
                "--listen",
                address,
                "--out",
                str(top),
                "--threads",
                str(THREADS),
                *global_args,
            ],
            stdout=open(tmp_path / "global-restarted.log", "w"),
            stderr=subprocess.STDOUT,
            env=child_env(),
        )
        procs.append(restarted)
        _wait_all(procs, tmp_path, timeout=240, skip=(coordinator,))
    finally:
        _kill_all(procs)
    rounds = read_metrics(top)
    assert [m["round"] for m in rounds] == [1, 2, 3] and [m["clients_ok"] for m in rounds] == [2, 2, 2]
    final, initial = load_model(top / "model.safetensors"), model_state("slow_app:model", seed=SEED)
    for name, tensor in initial.items():
        torch.testing.assert_close(final[name], tensor + 18.0, atol=1e-4, rtol=0)


def test_two_regions_of_three_clients_over_an_emulated_wan_learn_as_flat_does(tmp_path):
    """Each region reaches the global coordinator through its own emulated WAN link (25 ms each
    way: 50 ms RTT, 20 Mbit/s, 0.1% loss); regions run H = 2 rounds with their clients on the
    LAN and send int8 (with error feedback) over the WAN. Five global rounds reach the flat
    simulation's accuracy within 0.05 (the same six clients, FedAvg, five rounds)."""
    from fedgrid.ops.wan import WanLink, WanRelay

    top = tmp_path / "global"
    rounds = 5
    coordinator, address = start_coordinator(
        top, "--rounds", str(rounds), "--min-clients", "2", "--seed", str(SEED), "--codec", "int8"
    )
    procs, relays = [coordinator], []
    try:
        for r, name in enumerate(("region-a", "region-b")):
            relay = WanRelay(address, link=WanLink(delay_ms=25, rate_mbit=20, loss=0.001, seed=r)).start()
            relays.append(relay)
            region, region_address = start_region(
                tmp_path / name, relay.address, name, "--min-clients", "3", "--regional-rounds", "2"
            )
            procs.append(region)
            for i in range(3 * r, 3 * r + 3):
                procs.append(
                    start_client(
                        region_address,
                        tmp_path / f"client{i}.log",
                        "--partition",
                        f"{i}/6",
                        "--seed",
                        str(SEED),
                    )
                )
        _wait_all(procs, tmp_path, timeout=300)
    finally:
        _kill_all(procs)
        for relay in relays:
            relay.stop()
    metrics = read_metrics(top)
    assert [m["clients_ok"] for m in metrics] == [2] * rounds
    assert all(m["wall_s"] > 0.1 for m in metrics)  # a download and an upload each cross a 50 ms RTT at least
    for relay in relays:  # the WAN carried each region's int8 uplink and its float32 downloads, nothing else
        assert relay.bytes_down > rounds * 4 * 4000 and rounds * 4000 < relay.bytes_up < relay.bytes_down / 2
    _, flat = run_simulation(
        load_config(overrides={"rounds": rounds, "clients": 6, "seed": SEED, **REFERENCE})
    )
    assert abs(metrics[-1]["accuracy"] - flat[-1].accuracy) <= 0.05, (
        metrics[-1]["accuracy"],
        flat[-1].accuracy,
    )


def test_one_sigterm_ends_a_region_within_5_s_while_its_client_trains(tmp_path):
    """A stop that stops (issue 40, item 3): a region whose client is in a long task (100000 local
    epochs) ends within 5 s of one SIGTERM, as a coordinator does, and says it stopped."""
    import signal
    import time

    long_task = ["--local-epochs", "100000"]
    coordinator, address = start_coordinator(
        tmp_path / "global", "--rounds", "1", "--min-clients", "1", *long_task
    )
    region, region_address = start_region(
        tmp_path / "region-a", address, "region-a", "--min-clients", "1", *long_task
    )
    client_log = tmp_path / "client0.log"
    client = start_client(region_address, client_log, "--partition", "0/2", "--seed", str(SEED))
    procs = [coordinator, region, client]
    try:
        wait_until(  # the client's first progress line: 10 s into its task
            lambda: (
                "fedgrid.client.progress: round 1: step" in client_log.read_text()
                or client.poll() is not None
            ),
            timeout=120,
            what="the client's training",
        )
        assert client.poll() is None, client_log.read_text()[-3000:]
        region.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_until(lambda: region.poll() is not None, timeout=5.0, what="the region to exit after SIGTERM")
        print(
            f"stop of a region while its client trains: exited {time.monotonic() - signalled:.2f} s after SIGTERM"
        )
        log = (tmp_path / "region-a.log").read_text()
        assert region.returncode == 128 + signal.SIGTERM, log[-3000:]
        assert "region region-a: 0 global rounds trained; stopped" in log
    finally:
        _kill_all(procs)
