"""The command line: bad configuration fails before any work starts, naming the key."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from harness import FEDGRID, child_env


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*FEDGRID, *args], capture_output=True, text=True, env=child_env(), timeout=120)


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


def test_bad_toml_key_names_the_key(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('rounds = 3\nroundz = 4\n')
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
    config.write_text('rounds = 5\nclients = 4\nseed = 3\n')
    out = tmp_path / "run"
    result = _run("simulate", "--config", str(config), "--rounds", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "round   2/2" in result.stdout and "final test accuracy" in result.stdout
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    resolved = (out / "config.toml").read_text()
    assert "rounds = 2\n" in resolved and "clients = 4\n" in resolved and "seed = 3\n" in resolved
    assert (out / "model.safetensors").stat().st_size > 4810 * 4
    # the progress line: one plain line per round on stderr (not a terminal here)
    progress = [line for line in result.stderr.splitlines() if line.startswith("round ")]
    assert [line.split(" | ")[0] for line in progress] == ["round 1/2", "round 2/2"]
    for line, row in zip(progress, lines):
        fields = line.split(" | ")
        assert fields[1].endswith(" clients/s") and float(fields[1].split()[0]) > 0
        assert fields[2] == f"accuracy {json.loads(row)['accuracy']:.4f}" and fields[3] == f"loss {json.loads(row)['loss']:.4f}"
        assert re.fullmatch(r"ETA \d+:\d\d:\d\d", fields[4])
    assert progress[1].endswith("ETA 0:00:00")


def test_simulate_progress_off(tmp_path):
    result = _run("simulate", "--rounds", "1", "--clients", "2", "--local-epochs", "1", "--progress", "false", "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    assert "clients/s" not in result.stderr and "round   1/1" in result.stdout
