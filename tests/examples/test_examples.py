"""Every program in ``examples/`` runs, in a reduced form, and does what its docstring says.

The Shakespeare examples read a tiny synthetic ``gutenberg-texts.tar.gz``
(``tests/support/shakespeare_data.py``): a clean clone (CI) has no ``../shared/data``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from collections import OrderedDict
from pathlib import Path
from types import ModuleType

import pytest
import torch
from shakespeare_data import synthetic_shakespeare

from fedgrid.events import read_events
from fedgrid.runlog import load_model
from fedgrid.types import ClientInfo, Failure, FitRes

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# -- custom_strategy.py ----------------------------------------------------------------------
def _result(name: str, weight: float, examples: int) -> FitRes:
    state = OrderedDict([("w", torch.full((2,), weight)), ("steps", torch.tensor(7))])
    return FitRes(
        client=ClientInfo(client_id=f"id-{name}", name=name),
        state=state,
        num_examples=examples,
        metrics={"loss": weight},
    )


def test_custom_strategy_steps_towards_the_weighted_mean_in_canonical_order():
    ServerLRAvg = _load("custom_strategy").ServerLRAvg
    strategy = ServerLRAvg(server_lr=0.5)
    strategy.initialize(initial_state=OrderedDict([("w", torch.zeros(2)), ("steps", torch.tensor(0))]))
    results = [_result("b", 4.0, 30), _result("a", 1.0, 10)]
    failure = Failure(ClientInfo(client_id="id-c", name="c"), "timed out")
    metrics = strategy.aggregate(server_round=1, results=results, failures=[failure])
    # mean = (1 * 10 + 4 * 30) / 40 = 3.25; half a step from 0: 1.625. The integer buffer is kept.
    assert torch.equal(strategy.global_state["w"], torch.full((2,), 1.625))
    assert int(strategy.global_state["steps"]) == 0
    assert metrics == {"train_loss": 3.25, "failed_total": 1.0}

    again = ServerLRAvg(server_lr=0.5)
    again.initialize(initial_state=OrderedDict([("w", torch.zeros(2)), ("steps", torch.tensor(0))]))
    again.aggregate(server_round=1, results=results[::-1], failures=[])
    assert torch.equal(again.global_state["w"], strategy.global_state["w"])  # arrival order does not matter

    resumed = ServerLRAvg(server_lr=0.5)
    resumed.load_state_dict(strategy.state_dict())
    assert torch.equal(resumed.global_state["w"], strategy.global_state["w"]) and resumed.failed_total == 1


def test_custom_strategy_samples_its_fraction_and_decays_the_client_lr():
    strategy = _load("custom_strategy").ServerLRAvg(fraction_fit=0.5, client_lr=0.1, decay=0.5, seed=3)
    clients = [ClientInfo(client_id=str(i), name=f"c{i}") for i in range(10)]
    round1 = strategy.configure_round(server_round=1, clients=clients)
    round3 = strategy.configure_round(server_round=3, clients=clients[::-1])
    assert len(round1) == len(round3) == 5
    assert [c.name for c, _ in strategy.configure_round(server_round=1, clients=clients[::-1])] == [
        c.name for c, _ in round1
    ]
    assert round1[0][1].config["lr"] == pytest.approx(0.1) and round3[0][1].config["lr"] == pytest.approx(
        0.025
    )


def test_custom_strategy_example_learns_digits(capsys):
    accuracy = _load("custom_strategy").main(["--rounds", "5", "--clients", "6"])
    out = capsys.readouterr().out
    assert out.count("round ") == 5 and f"final accuracy {accuracy:.4f}" in out
    assert accuracy > 0.4  # chance is 0.1


# -- diloco_shakespeare.py -------------------------------------------------------------------
def test_diloco_shakespeare_example_lowers_the_held_out_loss(tmp_path, capsys):
    data_dir = synthetic_shakespeare(tmp_path / "shakespeare")
    torch_threads = torch.get_num_threads()
    try:
        before, after = _load("diloco_shakespeare").main(
            [
                "--data-dir",
                str(data_dir),
                "--workers",
                "2",
                "--rounds",
                "3",
                "--inner-steps",
                "10",
                "--seq-len",
                "16",
                "--test-windows",
                "128",
            ]
        )
    finally:
        torch.set_num_threads(torch_threads)
    out = capsys.readouterr().out
    assert "6 roles" in out and out.count("held-out loss") == 5  # round 0, 3 rounds, the summary
    assert before > 4.0  # about ln 80 untrained
    assert after < before - 1.0  # 30 inner steps per worker learn the characters' frequencies at least


# -- federated_lora.py -----------------------------------------------------------------------
def test_federated_lora_example_fine_tunes_with_adapters_only_on_the_wire(tmp_path, capsys):
    data_dir = synthetic_shakespeare(tmp_path / "shakespeare")
    argv = ["--data-dir", str(data_dir), "--work", str(tmp_path / "work"), "--pretrain-rounds", "1"]
    table = _load("federated_lora").main(
        [*argv, "--rounds", "1", "--clients", "2", "--steps", "5", "--no-memory"]
    )
    assert (tmp_path / "work" / "base" / "model.safetensors").is_file()  # the pretrained base, saved
    # r=8 on the 64x64 q and v projections of 2 layers: 16,384 bytes of adapters per client, against
    # the whole model's 378,112 bytes (with frame headers and names either way).
    assert table["bytes_up_per_round_full"] > 10 * table["bytes_up_per_round_lora"]
    assert table["bytes_down_per_round_full"] > 10 * table["bytes_down_per_round_lora"]
    for key in ("perplexity_federated_lora", "perplexity_local_only_lora", "perplexity_full_fedavg"):
        assert 1.0 < table[key] < table["perplexity_before"], (key, table)
    assert "perplexity_federated_lora" in capsys.readouterr().out


# -- gpt_two_regions.py ----------------------------------------------------------------------
def test_gpt_two_regions_example_trains_over_two_wan_links(tmp_path, capsys):
    data_dir = synthetic_shakespeare(tmp_path / "shakespeare")
    rows = _load("gpt_two_regions").main(
        [
            *("--data-dir", str(data_dir), "--model", "gpt:layers=1,heads=2,dim=32,context=16"),
            *("--rounds", "2", "--inner-steps", "15", "--delay-ms", "5", "--rate-mbit", "100"),
            *("--out", str(tmp_path / "run")),
        ]
    )
    assert [(r["round"], r["clients_ok"]) for r in rows] == [(1, 2), (2, 2)]
    assert all(r["perplexity"] == math.exp(r["loss"]) for r in rows)
    assert rows[1]["loss"] < rows[0]["loss"] < math.log(80)  # learning, from below a uniform guess
    assert all(0 < r["utilization"] <= 1 for r in rows)
    out = capsys.readouterr().out
    assert out.count("held-out loss") == 2 and "MB over 2 links" in out and "computing" in out


def test_gpt_two_regions_without_its_data_stops_before_any_process_naming_the_folder(tmp_path, capsys):
    (tmp_path / "a-file").write_text("not a folder")
    for data_dir in (tmp_path / "a-file", tmp_path / "missing", tmp_path):
        with pytest.raises(SystemExit) as stop:
            _load("gpt_two_regions").main(["--data-dir", str(data_dir), "--out", str(tmp_path / "run")])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.endswith(
            f"--data-dir {data_dir} is not a folder holding gutenberg-texts.tar.gz "
            "(the Shakespeare plays: see docs/simulation.rst's datasets table)"
        )
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
    doc = _load("gpt_two_regions").__doc__
    # The docstring points at a section that exists: the datasets table naming the file.
    assert "README's Shakespeare section" not in doc and "docs/simulation.rst's datasets table" in doc
    assert (
        "``gutenberg-texts.tar.gz`` in ``--data-dir``"
        in (EXAMPLES.parent / "docs" / "simulation.rst").read_text()
    )


# -- federated_loop.py -----------------------------------------------------------------------
def test_federated_loop_continues_from_the_federated_average(capsys):
    result = _load("federated_loop").main(["--rounds", "2", "--sync-every", "5"])
    log = result["log"]
    assert sorted((e["round"], e["site"]) for e in log) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for r in (1, 2):
        site0, site1 = (next(e for e in log if e["round"] == r and e["site"] == s) for s in (0, 1))
        assert site0["moved"] > 0.0 and site1["moved"] > 0.0  # the average differs from each site's own model
        for name, tensor in site0["state"].items():
            assert torch.equal(tensor, site1["state"][name]), name  # both continue from the same model
    final = load_model(result["run_dir"] / "model.safetensors")
    last = next(e for e in log if e["round"] == 2 and e["site"] == 0)["state"]
    for name, tensor in final.items():
        assert torch.equal(last[name], tensor), (
            name
        )  # the loop's model after the last sync is the federation's
    assert "site-0 step   10" in capsys.readouterr().out
    rows = [json.loads(line) for line in (result["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["clients_ok"], r["clients_evaluated"]) for r in rows] == [(1, 2, 2), (2, 2, 2)]
    events = [e.event for e in read_events(result["run_dir"] / "events.jsonl")]
    assert (
        events.count("client_joined") == 2 and "client_left" not in events
    )  # one session each, ended by the run
    assert len((EXAMPLES / "federated_loop.py").read_text().splitlines()) < 100  # what the docs promise


# -- federated_sft.py ------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
def test_federated_sft_example_tunes_lora_with_only_the_adapters_on_the_wire(tmp_path, capsys):
    table = _load("federated_sft").main(["--rounds", "2", "--inner-steps", "3", "--work", str(tmp_path)])
    assert table["rounds"] == 2
    # r=4 on the 32x32 q and v projections of 2 layers: 4,096 bytes of tensors, with the frames' names
    # and headers; the base's ~100 kB never travel.
    assert 4096 < table["bytes_up_per_round"] < 4096 + 1500
    assert 4096 < table["bytes_down_per_round"] < 4096 + 1500
    assert table["loss_after"] < table["loss_before"]
    assert "loss_after" in capsys.readouterr().out
