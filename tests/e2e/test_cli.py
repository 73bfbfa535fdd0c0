"""The command line: bad configuration fails before any work starts, naming the key."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest

import zygote
from harness import FEDGRID, THREADS, child_env, start_client, start_coordinator, wait_until


def _run(*args: str) -> subprocess.CompletedProcess:
    return zygote.run([*FEDGRID, *args], capture_output=True, text=True, env=child_env(), timeout=120)


@pytest.mark.parametrize(
    "args, key",
    [
        (["simulate", "--rounds", "0"], "rounds"),
        (["simulate", "--lr", "fast"], "lr"),
        (["simulate", "--partition", "dirichlet:-1"], "partition"),
        (["simulate", "--dataset", "imagenet"], "dataset"),
        (["coordinator", "--listen", "nowhere"], "listen"),
        (["coordinator", "--fraction-fit", "2"], "fraction_fit"),
    ],
)
def test_bad_flag_names_the_key_and_starts_nothing(tmp_path, args, key):
    out = tmp_path / "run"
    result = _run(*args, "--out", str(out))
    assert result.returncode == 2
    assert f"config key '{key}'" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "args, key, words",
    [
        (
            ["--nproc-per-node", "4", "--parallel", "hsdp:3x2"],
            "parallel",
            "R x S must equal nproc_per_node (4)",
        ),
        (["--nproc-per-node", "2", "--parallel", "zero"], "parallel", "expected dp, fsdp or hsdp:RxS"),
        (
            ["--nproc-per-node", "2", "--parallel", "fsdp", "--comm-hook", "powersgd:4"],
            "comm_hook",
            "is a DDP hook",
        ),
        (["--nproc-per-node", "0"], "nproc_per_node", "must be at least 1"),
    ],
)
def test_client_bad_parallel_flags_name_the_key(args, key, words):
    # An address that nobody serves: the flags must fail before any connection is tried.
    result = _run("client", "--coordinator", "127.0.0.1:9", "--connect-timeout-s", "1", *args)
    assert result.returncode == 2, result.stderr
    assert f"config key '{key}'" in result.stderr and words in result.stderr, result.stderr


def test_bad_toml_key_names_the_key(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("rounds = 3\nroundz = 4\n")
    result = _run("simulate", "--config", str(config), "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "config key 'roundz'" in result.stderr
    config.write_text('rounds = "three"\n')
    result = _run("simulate", "--config", str(config), "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "config key 'rounds': expected int" in result.stderr
    assert not (tmp_path / "run").exists()


def test_client_bad_partition(tmp_path):
    result = _run("client", "--coordinator", "127.0.0.1:1", "--partition", "3/3")
    assert result.returncode == 2 and "config key 'partition'" in result.stderr
    result = _run("client", "--coordinator", "127.0.0.1:1", "--app", "no.such.module:factory")
    assert result.returncode == 2 and "config key 'app'" in result.stderr
    result = _run("client", "--coordinator", "127.0.0.1:1", "--threads", "-1")
    assert result.returncode == 2 and "config key 'threads'" in result.stderr


def test_simulate_toml_then_flags(tmp_path):
    config = tmp_path / "run.toml"
    out = tmp_path / "run"
    config.write_text(
        f'rounds = 5\nclients = 4\nseed = 3\nout = "{out}"\n'
    )  # the file's out is the run directory
    result = _run("simulate", "--config", str(config), "--rounds", "2")
    assert result.returncode == 0, result.stderr
    assert "round   2/2" in result.stdout and "final test accuracy" in result.stdout
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    resolved = (out / "config.toml").read_text()
    assert "rounds = 2\n" in resolved and "clients = 4\n" in resolved and "seed = 3\n" in resolved
    assert (out / "model.safetensors").stat().st_size > 4810 * 4
    # Not a terminal here: each round's line once, on stdout; the progress line (clients/s, ETA) is
    # a terminal's, rewritten in place, and would only say the same thing again.
    assert [line for line in result.stderr.splitlines() if line.startswith("round ")] == []
    rounds = [line for line in result.stdout.splitlines() if line.startswith("round ")]
    assert [line.split()[1] for line in rounds] == ["1/2", "2/2"]
    for line, row in zip(rounds, lines):
        assert (
            f"accuracy {json.loads(row)['accuracy']:.4f}" in line
            and f"loss {json.loads(row)['loss']:.4f}" in line
        )


def test_simulate_progress_off(tmp_path):
    result = _run(
        "simulate",
        "--rounds",
        "1",
        "--clients",
        "2",
        "--local-epochs",
        "1",
        "--progress",
        "false",
        "--out",
        str(tmp_path / "run"),
    )
    assert result.returncode == 0, result.stderr
    assert "clients/s" not in result.stderr and "round   1/1" in result.stdout


# -- a CLI that behaves: Ctrl-C, a second Ctrl-C, a coordinator that is not there ----------
def _popen(*args: str, env: dict[str, str] | None = None, log=None) -> subprocess.Popen:
    return zygote.popen(
        [*FEDGRID, *args],
        stdout=log or subprocess.PIPE,
        stderr=subprocess.STDOUT if log else subprocess.PIPE,
        text=True,
        env={**child_env(), **(env or {})},
    )


def _slow_simulation(tmp_path: Path, fit_s: float, rounds: int) -> tuple[subprocess.Popen, Path]:
    markers = tmp_path / "markers"
    markers.mkdir()
    out = tmp_path / "run"
    proc = _popen(
        "simulate",
        "--app",
        "slow_app:client",
        "--model",
        "slow_app:model",
        "--clients",
        "2",
        "--rounds",
        str(rounds),
        "--threads",
        str(THREADS),
        "--progress",
        "false",
        "--out",
        str(out),
        env={"SLOW_APP_FIT_S": str(fit_s), "SLOW_APP_MARKER_DIR": str(markers)},
    )
    wait_until(
        lambda: (markers / "fit-0-1").exists() or proc.poll() is not None, timeout=60, what="round 1 to start"
    )
    return proc, out


def test_ctrl_c_in_simulate_abandons_the_open_round_and_keeps_the_last_model(tmp_path):
    proc, out = _slow_simulation(tmp_path, fit_s=0.5, rounds=5)
    wait_until(lambda: (out / "metrics.jsonl").read_text().strip() != "", timeout=60, what="round 1's commit")
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr  # 128 + SIGINT: an interrupted run is no success
    assert "Traceback" not in stderr + stdout
    done = len((out / "metrics.jsonl").read_text().splitlines())
    assert 1 <= done < 5
    assert "SIGINT: stopping (the open round is abandoned); a second one exits at once" in stdout
    assert (
        stdout.splitlines()[-1]
        == f"stopped after {done} of 5 rounds; model of round {done} in {out}/model.safetensors; run directory {out}"
    )
    assert (out / "model.safetensors").stat().st_size > 0


def test_a_second_ctrl_c_forces_the_exit_in_one_line(tmp_path):
    proc, _ = _slow_simulation(tmp_path, fit_s=60.0, rounds=2)  # the round would take two minutes
    assert proc.stdout is not None
    proc.send_signal(signal.SIGINT)
    lines = []
    wait_until(
        lambda: lines.append(proc.stdout.readline()) or "stopping (the open round is abandoned)" in lines[-1],
        timeout=30,
        what="the graceful stop to begin",
    )
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "Traceback" not in stderr
    assert stderr.splitlines()[-1] == "fedgrid simulate: SIGINT again while stopping: exiting now"
    assert not [
        line for line in stderr.splitlines()[:-1] if not re.match(r"\d{4}-\d\d-\d\d ", line)
    ]  # log lines only


def test_ctrl_c_stops_coordinator_and_client_gracefully(tmp_path):
    out = tmp_path / "run"
    coordinator, address = start_coordinator(
        out, "--min-clients", "2", env={"FEDGRID_WAITING_REPORT_S": "0.2"}
    )
    log = out.parent / f"{out.name}.coordinator.log"
    client = None
    try:
        wait_until(
            lambda: log.read_text().count("waiting for 2 clients (0 joined)") >= 3,
            timeout=60,
            what="periodic waiting lines",
        )
        client = start_client(address, tmp_path / "client.log", "--partition", "0/2")
        wait_until(
            lambda: "waiting for 2 clients (1 joined)" in log.read_text(),
            timeout=60,
            what="the client's join",
        )
        client.send_signal(signal.SIGINT)
        assert client.wait(timeout=60) == 130
        coordinator.send_signal(signal.SIGINT)
        assert coordinator.wait(timeout=60) == 130
    finally:
        for p in (coordinator, client):
            if p is not None and p.poll() is None:
                p.kill()
    client_log, coordinator_log = (tmp_path / "client.log").read_text(), log.read_text()
    assert "Traceback" not in client_log + coordinator_log
    assert client_log.splitlines()[-1].endswith(": stopped; left the federation")
    assert "SIGINT: stopping; a second one exits at once" in coordinator_log
    assert (
        coordinator_log.splitlines()[-1]
        == "stopped after 0 of 10 rounds (no --state-dir: nothing to resume from)"
    )
    assert "committed" not in coordinator_log


def test_client_config_file_and_an_unreachable_coordinator_in_one_line(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "run.toml"
    config.write_text(
        "rounds = 3\nthreads = 2\nbatch_size = 16\n"
    )  # threads: the file's, not torch's default of 1 here
    result = _run(
        "client", "--config", str(config), "--coordinator", f"127.0.0.1:{port}", "--connect-timeout-s", "1"
    )
    assert result.returncode == 1
    assert "fedgrid client 0/1: 2 threads" in result.stdout
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[-1].startswith(
        f"fedgrid: error: could not reach the coordinator at 127.0.0.1:{port} within 1s (UNAVAILABLE: "
    )
    assert lines[-1].endswith(
        f"check that it is running, that 127.0.0.1:{port} is its address and port (RUN_DIR/address), "
        "and that the coordinator serves plaintext (one with mutual TLS needs --ca, --cert and --key)"
    )
    # One line for the first failure, then one per doubling of the time waited (none within 1 s), not one per try.
    [retries] = lines[:-1]
    assert re.match(
        r"\d{4}-\d\d-\d\d .* INFO fedgrid\.client\.connection: Join on 127\.0\.0\.1:\d+: UNAVAILABLE: .*; "
        r"retrying for up to 1s$",
        retries,
    ), retries


def test_a_port_in_use_is_one_line_not_a_traceback(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A fresh interpreter, not the zygote's fork: gRPC reads GRPC_VERBOSITY once, at its import.
        result = subprocess.run(
            [
                *FEDGRID,
                "coordinator",
                "--listen",
                f"127.0.0.1:{port}",
                "--rounds",
                "1",
                "--out",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            env={k: v for k, v in child_env().items() if k != "GRPC_VERBOSITY"},
            timeout=120,
        )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "add_port.cc" not in result.stderr, result.stderr
    [line] = [line for line in result.stderr.splitlines() if "plaintext on loopback" not in line]
    assert line == (
        f"fedgrid: error: cannot listen on 127.0.0.1:{port}: the port is in use (another coordinator?) or the "
        "address is not this host's; pick another with --listen HOST:PORT (port 0: any free one)"
    )


def test_a_client_refuses_plaintext_to_a_coordinator_off_loopback_unless_told(tmp_path):
    result = _run("client", "--coordinator", "192.0.2.7:50051", "--connect-timeout-s", "1")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        "fedgrid: error: config key 'coordinator': 192.0.2.7:50051 is not a loopback address, and plaintext "
        "there lets anyone on the path read and change the model: give --ca, --cert and --key (mutual TLS; "
        "see `fedgrid certs`), or --insecure to connect in plaintext anyway\n"
    )
    # Told: it dials (192.0.2.0/24 is TEST-NET-1, reachable nowhere) and gives up after its deadline.
    result = _run("client", "--coordinator", "192.0.2.7:50051", "--connect-timeout-s", "1", "--insecure")
    assert result.returncode == 1
    assert "could not reach the coordinator at 192.0.2.7:50051" in result.stderr.splitlines()[-1]
