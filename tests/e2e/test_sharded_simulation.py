"""``torchrun --nproc-per-node 2 -m fedgrid.cli simulate``: the clients sharded across two gloo
ranks give the single-process model, bit for bit on the sequential engine at the same thread
count and within ``BATCHED_ATOL`` on the batched engine, with the same bytes counted."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fedgrid.config import load_config
from fedgrid.determinism import BATCHED_ATOL
from fedgrid.runlog import load_model, read_metrics
from fedgrid.simulation.run import run_simulation

from harness import THREADS, child_env

SETTINGS = {
    "clients": 7,
    "rounds": 2,
    "seed": 4,
    "threads": THREADS,
    "codec": "int8",
}  # 7: the ranks' shares differ (4 and 3)


def _torchrun(out, *flags: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "fedgrid.cli",
        "simulate",
        "--out",
        str(out),
        *[f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items()],
        *flags,
    ]
    return subprocess.run(command, capture_output=True, text=True, env=child_env(), timeout=240)


@pytest.mark.parametrize("engine", ["sequential", "batched"])
def test_two_ranks_give_the_single_process_model(tmp_path, engine):
    result = _torchrun(tmp_path / "ranks", "--engine", engine)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("final test accuracy") == 1  # rank 0 speaks for the run
    single, history = run_simulation(
        load_config(overrides={**SETTINGS, "engine": engine, "out": str(tmp_path / "one")})
    )
    sharded = load_model(tmp_path / "ranks" / "model.safetensors")
    for name, tensor in single.items():
        if engine == "sequential":
            assert torch.equal(sharded[name], tensor), name
        else:
            torch.testing.assert_close(sharded[name], tensor, atol=BATCHED_ATOL, rtol=0)
    for one, many in zip(history, read_metrics(tmp_path / "ranks")):
        assert one.clients_ok == 7 and (many["bytes_up"], many["bytes_down"], many["clients_ok"]) == (
            one.bytes_up,
            one.bytes_down,
            7,
        )
        assert many["uplink_ratio"] == pytest.approx(one.extra["uplink_ratio"], rel=1e-12)  # int8: about 4


def test_over_selection_is_refused_across_ranks(tmp_path):
    result = _torchrun(
        tmp_path / "ranks", "--engine", "sequential", "--clients-per-round", "3", "--over-selection", "1"
    )
    assert result.returncode != 0
    assert "config key 'over_selection'" in result.stdout + result.stderr
