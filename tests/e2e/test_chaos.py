"""A seeded chaos run (``benchmarks/chaos.py``, shorter): a two-region federation through
emulated WAN links, with a region, a client and the global coordinator SIGKILLed mid-round and
restarted, ends on exactly the model of the same hierarchy without faults (simulated in this
process: bit for bit a deployment's, docs/regions.rst), every global and regional round once
(issue 26, item 7). The benchmark runs every kind of fault, the full disk and the WAN
partition included (``tests/e2e/test_full_disk.py`` covers the full disk on its own)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import chaos  # noqa: E402

from fedgrid.runlog import load_model, read_metrics  # noqa: E402

ROUNDS, SEED, H = 5, 5, 2
KINDS = ("region_kill", "client_kill", "coordinator_kill")


def test_a_seeded_chaos_run_ends_on_the_model_without_faults(tmp_path):
    faults = chaos.schedule(SEED, ROUNDS, KINDS)
    assert sorted(f.kind for f in faults) == sorted(KINDS)  # each once, rounds 2 to 4
    run = chaos.run_federation(tmp_path, rounds=ROUNDS, seed=SEED, h=H, hold_s=1.0, faults=faults)
    report = run.tally()
    assert report.survived == len(faults) and report.coordinator_starts == 2
    assert report.rounds_redone >= 1  # the coordinator's killed round ran again after its restart
    assert [m["round"] for m in read_metrics(tmp_path / "global")] == list(range(1, ROUNDS + 1))
    assert all(m["clients_ok"] == 2 for m in read_metrics(tmp_path / "global"))
    for name in chaos.REGIONS:
        assert [m["round"] for m in read_metrics(tmp_path / name)] == list(range(1, ROUNDS * H + 1))
    expected = chaos.simulated_model(tmp_path, rounds=ROUNDS, seed=SEED, h=H)
    final = load_model(tmp_path / "global" / "model.safetensors")
    assert set(final) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name
