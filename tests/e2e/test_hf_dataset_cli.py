"""``--dataset hf:PATH`` on the command line: a user's local JSONL trains a tiny local Llama in
``fedgrid simulate`` and in ``fedgrid client`` processes joining a coordinator of the model alone;
bad data, columns and partitions are refused before anything starts. Files only, nothing downloaded."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedgrid.runlog import read_metrics
from fedgrid.simulation.hf_data import HFPartition, load_text, partition_indices, site_windows

import zygote
from harness import FEDGRID, THREADS, child_env, start_client, start_coordinator
from tiny_hf import tiny_llama_folder

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

#: The tiny Llama's context: its 64 positions (``max_position_embeddings``).
CONTEXT = 64


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama folder with its character tokenizer, and 60 rows of sums by 4 users."""
    root = tmp_path_factory.mktemp("hfdata")
    rows = [
        {
            "prompt": f"question {i}: add {i % 7} and {i % 5} =",
            "completion": f" {i % 7 + i % 5}",
            "user": f"u{i % 4}",
        }
        for i in range(60)
    ]
    data = root / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tiny_llama_folder(root / "llama"), data


def _data_flags(model: Path, data: Path) -> list[str]:
    return ["--dataset", f"hf:{data}", "--text-column", "prompt,completion", "--model", f"hf:{model}"]


def _simulate(out: Path, model: Path, data: Path, *flags: str) -> subprocess.CompletedProcess:
    return zygote.run(
        [
            *FEDGRID,
            "simulate",
            *_data_flags(model, data),
            "--out",
            str(out),
            "--threads",
            str(THREADS),
            *flags,
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=240,
    )


def test_simulate_trains_on_local_jsonl_with_the_same_loss_for_the_same_seed(files, tmp_path):
    model, data = files
    flags = ["--clients", "2", "--rounds", "2", "--strategy", "fedavg", "--local-epochs", "1"]
    flags += ["--partition", "natural:user", "--seed", "3"]
    runs = [_simulate(tmp_path / f"run{k}", model, data, *flags) for k in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    first, second = (read_metrics(tmp_path / f"run{k}") for k in range(2))
    losses = [row["loss"] for row in first]
    assert all(math.isfinite(x) for x in losses) and len(losses) == 2
    assert losses == [row["loss"] for row in second]  # the same seed: the same bits
    assert losses[0] < math.log(128)  # the test windows' loss, off uniform over the 128 tokens
    # The partition: each user's rows at one site, the two sites' windows every training window once.
    text = load_text(f"hf:{data}", CONTEXT, "prompt,completion", str(model))
    part = HFPartition.parse("natural:user")
    sites = [site_windows(text, part, 2, k, 3)[0] for k in range(2)]
    rows = partition_indices(text.rows, part, 2, 3)
    users = [{text.rows[int(r)]["user"] for r in site} for site in rows]
    assert users[0].isdisjoint(users[1]) and len(users[0]) + len(users[1]) == 4
    assert len(sites[0]) + len(sites[1]) == len(text.train_rows) == first[0]["examples"]
    assert min(len(s) for s in sites) > 0


def test_a_client_joins_a_coordinator_of_the_model_alone_with_its_local_data(files, tmp_path):
    model, data = files
    out = tmp_path / "run"
    proc, address = start_coordinator(
        out,
        "--model",
        f"hf:{model}",
        "--rounds",
        "1",
        "--min-clients",
        "2",
        "--strategy",
        "fedavg",
        "--local-epochs",
        "1",
    )
    clients = [
        start_client(
            address,
            tmp_path / f"client{k}.log",
            *_data_flags(model, data),
            "--data-partition",
            "iid",
            "--partition",
            f"{k}/2",
        )
        for k in range(2)
    ]
    try:
        assert proc.wait(timeout=240) == 0, (tmp_path / "run.coordinator.log").read_text()[-3000:]
        for k, client in enumerate(clients):
            assert client.wait(timeout=60) == 0, (tmp_path / f"client{k}.log").read_text()[-3000:]
    finally:
        for p in [proc, *clients]:
            if p.poll() is None:
                p.kill()
    (row,) = read_metrics(out)
    text = load_text(f"hf:{data}", CONTEXT, "prompt,completion", str(model))
    assert row["clients_ok"] == 2 and row["examples"] == len(text.train_rows)  # iid: every window once


#: Each bad option, the config key its error names and what the message says.
BAD_OPTIONS = [
    (["--dataset", "hf:someone/reviews"], "dataset", "save_to_disk('data/reviews')"),
    (["--text-column", "body"], "text_column", "no column 'body'; its columns: prompt, completion, user"),
    (
        ["--partition", "dirichlet:0.5:label=stars"],
        "label_column",
        "no column 'stars'; its columns: prompt, completion, user",
    ),
    (["--partition", "natural:country"], "partition", "no column 'country'"),
    (["--partition", "shard:two:label=user"], "partition", "'two'"),
    (["--partition", "zipf:2"], "partition", "unknown partitioner 'zipf:2'"),
]


def _bad_line(command: str, model: Path, data: Path, out: Path, flags: list[str]) -> list[str]:
    """The ``fedgrid`` arguments of ``command`` with ``flags``; a client names a coordinator where
    nothing listens: it must fail before it connects."""
    base = _data_flags(model, data)
    if command == "client":
        flags = ["--data-partition" if f == "--partition" else f for f in flags]
        return ["client", "--coordinator", "127.0.0.1:9", *base, *flags]
    return ["simulate", *base, "--out", str(out), *flags]


@pytest.mark.parametrize(("flags", "key", "message"), BAD_OPTIONS)
@pytest.mark.parametrize("command", ["simulate", "client"])
def test_bad_data_options_are_named_before_anything_starts(
    files, tmp_path, capsys, command, flags, key, message
):
    """Every bad option through the command's own ``main`` (in this process: the error is the
    same code path a process takes; the process itself is checked below, once per command)."""
    from fedgrid.cli import main

    model, data = files
    assert main(_bad_line(command, model, data, tmp_path / "run", flags)) == 2
    err = capsys.readouterr().err
    assert f"config key '{key}'" in err and message in err, err[-2000:]
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.parametrize("command", ["simulate", "client"])
def test_a_bad_data_option_ends_the_process_with_status_2_and_its_error(files, tmp_path, command):
    model, data = files
    flags, key, message = BAD_OPTIONS[2]  # read from the data's columns, after the file is loaded
    line = [*FEDGRID, *_bad_line(command, model, data, tmp_path / "run", flags)]
    run = zygote.run(line, capture_output=True, text=True, env=child_env(), timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"config key '{key}'" in run.stderr and message in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_numeric_model_is_refused_for_hf_data(files, tmp_path, capsys):
    from fedgrid.cli import main

    _, data = files
    assert main(["simulate", "--dataset", f"hf:{data}", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "config key 'model'" in err and "causal language model" in err, err[-2000:]
    assert not (tmp_path / "run").exists()


def test_site_windows_cover_the_train_windows_once_under_every_partitioner(files):
    model, data = files
    text = load_text(f"hf:{data}", CONTEXT, "prompt,completion", str(model))
    for spec in ("iid", "natural:user", "dirichlet:0.5:label=user", "shard:1:label=user"):
        parts = [site_windows(text, HFPartition.parse(spec), 2, k, 0)[0] for k in range(2)]
        merged = np.sort(np.concatenate(parts))
        np.testing.assert_array_equal(merged, np.arange(len(text.train_rows)), err_msg=spec)


ROOT = Path(__file__).resolve().parents[2]


def _docs_block(marker: str) -> str:
    """The shell block after ``marker`` in docs/trainers.rst, unindented."""
    text = (ROOT / "docs" / "trainers.rst").read_text()
    after = text[text.index(marker) :]
    body = after[after.index(".. code-block:: sh\n\n") + len(".. code-block:: sh\n\n") :]
    lines = []
    for line in body.splitlines():
        if line and not line.startswith("   "):
            break
        lines.append(line[3:])
    return "\n".join(lines).strip() + "\n"


def test_the_docs_command_trains_on_the_example_jsonl_as_written(tmp_path):
    block = _docs_block("two rounds, from the repository's root")
    assert "fedgrid simulate --dataset hf:examples/data/instructions.jsonl" in block
    (tmp_path / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    (tmp_path / "block.sh").write_text(block)
    env = {**child_env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run(
        ["bash", "-e", "block.sh"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=240
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = read_metrics(tmp_path / "runs" / "my-data")
    assert [r["round"] for r in rows] == [1, 2] and all(r["clients_ok"] == 2 for r in rows)
    assert all(math.isfinite(r["loss"]) and r["loss"] < math.log(128) for r in rows)
