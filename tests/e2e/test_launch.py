"""``fedgrid launch TOPOLOGY.toml``: a multi-region topology as local processes, over mutual TLS.

The runs use two regions of one client each (five processes fit two cores): enough for
every tier's run directory, per-region H and per-link codecs to show in the metrics.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedgrid.errors import ConfigError
from fedgrid.ops.launch import load_topology
from fedgrid.runlog import read_metrics

from harness import child_env, wait_until

LAUNCH = [sys.executable, "-m", "fedgrid.cli", "launch"]

SMALL = """
[global]
rounds = 10
seed = 4
min_clients = 2
region_codecs = "region-a=int8"   # region-b's WAN uplink: the global codec, none
threads = 1

[clients]
num_partitions = 4
threads = 1

[[regions]]
name = "region-a"
regional_rounds = 2
codec = "bf16"
partitions = [0]
threads = 1

[[regions]]
name = "region-b"
regional_rounds = 1
clients = 1
threads = 1
"""


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_launch_runs_every_tier_and_writes_its_metrics(tmp_path):
    topology = tmp_path / "topology.toml"
    topology.write_text(SMALL)
    out = tmp_path / "out"
    done = subprocess.run(
        [*LAUNCH, str(topology), "--rounds", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=280,
    )
    logs = {p.relative_to(out): p.read_text()[-1500:] for p in out.rglob("*.log")}
    assert done.returncode == 0, (done.stdout, done.stderr, logs)
    lines = done.stdout.splitlines()

    top = read_metrics(out / "global")
    assert [m["round"] for m in top] == [1, 2] and all(
        m["clients_ok"] == 2 and m["clients_failed"] == 0 for m in top
    )
    rounds = [line for line in lines if line.startswith("fedgrid launch: global round ")]
    assert len(rounds) == 2
    for row, line in zip(top, rounds):
        assert line.startswith(
            f"fedgrid launch: global round {row['round']}/2: loss {row['loss']:.4f}, accuracy {row['accuracy']:.4f}; "
            "regions 2 ok, 0 failed; WAN "
        )
        assert f"region-a {row['bytes_up.region-a'] / 1e3:.1f} kB/" in line
    assert (
        lines[-1]
        == f"fedgrid launch: run finished: 2 global rounds; model {out}/global/model.safetensors; run directories under {out}"
    )
    assert (out / "global" / "model.safetensors").exists() and (out / "global" / "state").is_dir()

    # Each region ran its own H regional rounds per global round, and counted its WAN tasks.
    for name, h, partition in (("region-a", 2, 0), ("region-b", 1, 1)):
        lan = read_metrics(out / name)
        assert [m["round"] for m in lan] == list(range(1, 2 * h + 1)) and all(
            m["clients_ok"] == 1 for m in lan
        )
        wan = [json.loads(line) for line in (out / name / "wan.jsonl").read_text().splitlines()]
        assert [w["round"] for w in wan] == [1, 2]
        assert (
            f"client digits-{partition:04d}/4: {2 * h} rounds trained; run finished"
            in (out / name / f"client-{partition}.log").read_text()
        )
        assert (out / name / "state").is_dir() and (
            out / name / "client-state" / f"client-{partition}.pt"
        ).exists()
    # Per-link codecs: region-a's WAN uplink is int8 (a quarter of float32, plus scales), region-b's uncompressed.
    a, b = top[0]["bytes_up.region-a"], top[0]["bytes_up.region-b"]
    assert a < 0.4 * b, (a, b)
    # Mutual TLS everywhere: the certificates under OUT/certs, and the clients joined under theirs.
    assert {p.name for p in (out / "certs").glob("*.pem")} >= {
        "ca.pem",
        "global.pem",
        "region-a.pem",
        "region-a-lan.pem",
        "client-0.pem",
    }
    assert "accepted update from 'client-0'" in (out / "region-a" / "region.log").read_text()


def test_ctrl_c_stops_every_process(tmp_path):
    topology = tmp_path / "topology.toml"
    topology.write_text(SMALL)
    out = tmp_path / "out"
    stdout = tmp_path / "launch.out"
    launcher = subprocess.Popen(
        [*LAUNCH, str(topology), "--rounds", "500", "--out", str(out)],
        stdout=open(stdout, "w"),
        stderr=subprocess.STDOUT,
        env=child_env(),
    )
    try:
        # Every process started: both regions listen and their clients were spawned after.
        wait_until(
            lambda: stdout.read_text().count("fedgrid launch: region ") == 2 or launcher.poll() is not None,
            timeout=180,
            what="both regions to start",
        )
        assert launcher.poll() is None, stdout.read_text()
        children = children_of(launcher.pid)
        assert len(children) == 5, children  # coordinator, 2 regions, 2 clients
        started = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        status = launcher.wait(timeout=60)
        took = time.monotonic() - started
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = stdout.read_text()
    assert status == 128 + signal.SIGINT, text
    assert (
        text.splitlines()[-1].startswith("fedgrid launch: SIGINT: stopped 5 processes")
        and "killed" not in text
    ), text
    assert took < 30, took  # each stops on SIGTERM well within the grace
    assert [pid for pid in children if alive(pid)] == []


def test_a_failing_process_stops_the_others_and_is_named(tmp_path):
    topology = tmp_path / "topology.toml"
    # A value only the client's own check refuses (the built-in task's optimizers).
    topology.write_text(SMALL.replace("[clients]", '[clients]\noptimizer = "nosuch"'))
    out = tmp_path / "out"
    launcher = subprocess.Popen(
        [*LAUNCH, str(topology), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        stdout, stderr = launcher.communicate(timeout=200)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1, (stdout, stderr)
    line = stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"fedgrid: error: client-[01] exited with status 2: fedgrid: error: .*optimizer.*nosuch.* \(log .*/client-[01]\.log\)",
        line,
    ), line
    assert "fedgrid launch: global round" not in stdout
    # The others were stopped: the coordinator and both regions logged their SIGTERM.
    for log in (
        out / "global" / "coordinator.log",
        out / "region-a" / "region.log",
        out / "region-b" / "region.log",
    ):
        assert "SIGTERM" in log.read_text(), log


@pytest.mark.parametrize(
    "edit,key,problem",
    [
        (
            ('codec = "bf16"', 'codecc = "bf16"'),
            "regions.region-a.codecc",
            "unknown key (did you mean 'codec'?)",
        ),
        (
            ("threads = 1\n\n[clients]", 'threads = 1\nlisten = "0.0.0.0:1"\n\n[clients]'),
            "global.listen",
            "is set by fedgrid launch",
        ),
        (
            ("clients = 1", "partitions = [0]"),
            "regions.region-b.partitions",
            "partition 0 is also region-a's",
        ),
        (
            ("region-a=int8", "region-c=int8"),
            "global.region_codecs",
            "names 'region-c', which is no region of the file",
        ),
        (('codec = "bf16"', 'codec = "bf17"'), "regions.region-a.codec", "bf17"),
        (
            ("clients = 1", "clients = 2\npartitions = [3]"),
            "regions.region-b.clients",
            "is 2 but partitions lists 1",
        ),
        (
            ("num_partitions = 4", "num_partitions = 1"),
            "clients.num_partitions",
            "partition 1 (region-b's) is outside 0..0",
        ),
        (("[clients]", "[clients]\nseed = 3"), "clients.seed", "is set by fedgrid launch"),
        (("[global]", "[globl]"), "globl", "unknown table (did you mean 'global'?)"),
        (("[clients]", '[clients]\nmodel = "cnn"'), "clients.model", "goes in [global]"),
    ],
)
def test_a_bad_topology_names_the_key(tmp_path, edit, key, problem):
    assert edit[0] in SMALL
    path = tmp_path / "topology.toml"
    path.write_text(SMALL.replace(edit[0], edit[1], 1))
    with pytest.raises(ConfigError) as caught:
        load_topology(path)
    assert (
        caught.value.key == key
        and str(caught.value).startswith(f"{path}: key '{key}': ")
        and problem in str(caught.value)
    )


def test_the_command_exits_2_on_a_bad_topology_before_it_starts_anything(tmp_path):
    path = tmp_path / "topology.toml"
    path.write_text(SMALL.replace("regional_rounds = 2", "regional_rounds = 0"))
    out = tmp_path / "out"
    done = subprocess.run(
        [*LAUNCH, str(path), "--out", str(out)], capture_output=True, text=True, env=child_env(), timeout=100
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert (
        done.stderr
        == f"fedgrid: error: {path}: key 'regions.region-a.regional_rounds': must be at least 1, got 0\n"
    )
    assert not out.exists()


def test_each_table_takes_the_keys_of_its_command():
    """The tables' keys are the flags of ``fedgrid coordinator``, ``region`` and ``client``, less what the launcher sets
    (this module may not import the CLI: the lists are its, checked here against the CLI's)."""
    from fedgrid import cli
    from fedgrid.ops import launch

    managed = launch.MANAGED_KEYS
    assert launch.GLOBAL_KEYS == set(cli.COORDINATOR_KEYS) - managed
    assert launch.REGION_KEYS == set(cli.REGION_KEYS) - managed - {"seed"}
    assert launch.CLIENT_KEYS == set(cli.CLIENT_CONFIG_KEYS) - managed


def test_the_shipped_topology_parses():
    top = load_topology(Path(__file__).resolve().parents[2] / "docker" / "topology.toml", rounds=3)
    assert top.rounds == 3 and top.num_partitions == 6 and top.seed == 0
    assert [(r.name, r.partitions, r.keys["regional_rounds"], r.keys["codec"]) for r in top.regions] == [
        ("region-a", (0, 1, 2), 2, "bf16"),
        ("region-b", (3, 4, 5), 2, "bf16"),
    ]
    assert top.global_keys["region_codecs"] == "region-a=int8,region-b=int8"
