"""Unit tests of ``fedgrid.simulation.run.run_simulation``: a small in-process run, end to end."""

from __future__ import annotations

import json
import math

import pytest
import tomllib
import torch

from fedgrid.config import load_config
from fedgrid.runlog import load_model
from fedgrid.simulation.run import run_simulation
from fedgrid.simulation.tasks import build_model, initial_state, make_evaluate
from fedgrid.telemetry import without_timing

KEYS = {"round", "loss", "accuracy", "bytes_up", "bytes_down", "wall_s", "clients_ok", "clients_failed"}


def _run(tmp_path_factory, seed: int, name: str):
    out = tmp_path_factory.mktemp(name)
    config = load_config(overrides={"rounds": 2, "clients": 3, "seed": seed, "out": str(out)})
    seen = []
    final, history = run_simulation(config, on_round=seen.append)
    return config, out, final, history, seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {
        "a": _run(tmp_path_factory, 0, "seed0-a"),
        "b": _run(tmp_path_factory, 0, "seed0-b"),
        "c": _run(tmp_path_factory, 1, "seed1"),
    }


def test_same_seed_bit_identical_model(runs):
    _, out_a, final_a, _, _ = runs["a"]
    _, out_b, final_b, _, _ = runs["b"]
    assert list(final_a) == list(final_b)
    for name in final_a:
        assert torch.equal(final_a[name], final_b[name]), name
    disk_a, disk_b = load_model(out_a / "model.safetensors"), load_model(out_b / "model.safetensors")
    for name in final_a:
        assert torch.equal(disk_a[name], final_a[name]) and torch.equal(disk_b[name], final_a[name]), name


def test_same_seed_same_metrics(runs):
    for ha, hb in zip(runs["a"][3], runs["b"][3], strict=True):
        # Timing (the round's wall_s, its workers' seconds) is measured, not computed: never equal.
        assert without_timing(ha.to_json()) == without_timing(hb.to_json())


def test_different_seed_different_model(runs):
    final_a, final_c = runs["a"][2], runs["c"][2]
    assert list(final_a) == list(final_c)
    assert not torch.equal(final_a["0.weight"], final_c["0.weight"])


def test_metrics_jsonl(runs):
    config, out, final, history, seen = runs["a"]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    rows = [json.loads(line) for line in lines]
    for i, row in enumerate(rows, start=1):
        assert KEYS <= set(row)
        assert row["round"] == i
        assert row["clients_ok"] == 3 and row["clients_failed"] == 0
        assert row["bytes_up"] > 0 and row["bytes_down"] > 0
        assert row["wall_s"] >= 0.0
        assert math.isfinite(row["loss"]) and row["loss"] > 0.0
        assert 0.0 <= row["accuracy"] <= 1.0
        # Simulated seconds: each client trains its examples at the simulated speed, then waits
        # for the slowest (sim_round_s); nothing crosses a network.
        assert row["worker_wall_s"] == 3 * row["sim_round_s"] and row["comm_s"] == 0
        assert row["compute_s"] + row["wait_s"] == pytest.approx(row["worker_wall_s"])
        assert row["utilization"] == row["compute_s"] / row["worker_wall_s"] and 0 < row["utilization"] <= 1
    assert rows == [m.to_json() for m in history]
    assert [m.round for m in seen] == [1, 2]  # on_round saw every round


def test_bytes_match_model_size(runs):
    history = runs["a"][3]
    state = initial_state(lambda: build_model("digits"), seed=0)
    payload = sum(t.numel() * t.element_size() for t in state.values())  # 4,810 float32 parameters
    for m in history:
        # three clients each move the whole model both ways, plus per-message framing
        assert 3 * payload < m.bytes_down < 3 * payload + 3 * 1024
        assert 3 * payload < m.bytes_up < 3 * payload + 3 * 1024
        assert m.bytes_up == history[0].bytes_up


def test_loss_and_accuracy_are_server_evaluation_of_final_model(runs):
    final, history = runs["a"][2], runs["a"][3]
    loss, metrics = make_evaluate("digits")(final)
    assert history[-1].loss == loss
    assert history[-1].accuracy == metrics["accuracy"]
    assert history[-1].accuracy > 0.5  # two rounds of FedAvg on digits learn something


def test_run_dir_config_toml(runs):
    config, out = runs["a"][0], runs["a"][1]
    parsed = tomllib.loads((out / "config.toml").read_text())
    environment = parsed.pop("environment")
    # What ran: the thread count in force and the engine auto chose, in place of 0 and "auto".
    resolved = {**config.to_dict(), "threads": environment["threads"], "engine": parsed["engine"]}
    assert parsed == {k: v for k, v in resolved.items() if v is not None}  # unset strategy options: absent
    assert parsed["threads"] >= 1 and parsed["engine"] in ("batched", "sequential")
    assert (environment["threads_requested"], environment["engine_requested"]) == (
        config.threads,
        config.engine,
    )
    assert load_config(out / "config.toml") == load_config(
        overrides={**config.to_dict(), "threads": parsed["threads"], "engine": parsed["engine"]}
    )
