"""``intra_op_threads`` pins and restores torch's thread count; runs record what they ran on."""

from __future__ import annotations

import pytest
import tomllib
import torch

from fedgrid.config import load_config
from fedgrid.determinism import environment, intra_op_threads
from fedgrid.simulation.run import run_simulation


def test_intra_op_threads_sets_and_restores():
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with intra_op_threads(target) as threads:
        assert threads == target == torch.get_num_threads()
    assert torch.get_num_threads() == before
    with intra_op_threads(0) as threads:  # 0: torch's current count, untouched
        assert threads == before
    assert torch.get_num_threads() == before


def test_intra_op_threads_restores_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError):
        with intra_op_threads(1 if before != 1 else 2):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("bad", [-1, 1025])
def test_intra_op_threads_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="threads must be in 0..1024"):
        with intra_op_threads(bad):
            pass


def test_environment_names_torch_and_threads():
    env = environment(engine_requested="auto")
    assert env["torch"] == torch.__version__ and env["threads"] == torch.get_num_threads()
    assert env["engine_requested"] == "auto" and env["cpu"]


def test_run_directory_records_threads_engine_and_torch_and_reruns_bit_for_bit(tmp_path):
    """``config.toml`` holds the thread count and the engine actually used (``auto`` resolved),
    so ``load_config(RUN/config.toml)`` reruns the run to the same bits."""
    first = load_config(
        overrides={
            "rounds": 2,
            "clients": 3,
            "seed": 4,
            "local_epochs": 1,
            "threads": 1,
            "engine": "auto",
            "progress": False,
            "out": str(tmp_path / "a"),
        }
    )
    state, _ = run_simulation(first)
    recorded = tomllib.loads((tmp_path / "a" / "config.toml").read_text())
    assert recorded["threads"] == 1
    assert recorded["engine"] in ("batched", "sequential")  # never "auto": what ran
    assert recorded["environment"]["torch"] == torch.__version__
    assert (
        recorded["environment"]["engine_requested"] == "auto"
        and recorded["environment"]["threads_requested"] == 1
    )
    again, _ = run_simulation(load_config(tmp_path / "a" / "config.toml", {"out": str(tmp_path / "b")}))
    for name, tensor in state.items():
        assert torch.equal(again[name], tensor), name
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()
