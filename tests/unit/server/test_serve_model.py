"""Where a coordinator's initial model comes from, without dataset code."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from fedgrid.config import load_config
from fedgrid.errors import ConfigError
from fedgrid.runlog import RunWriter
from fedgrid.server.serve import coordinator_model, run_coordinator


def test_initial_model_file_is_loaded_in_model_order(tmp_path):
    state = OrderedDict([("fc2.weight", torch.randn(2, 3)), ("fc1.weight", torch.randn(3, 4))])
    path = RunWriter(tmp_path / "run", {}).write_model(state)
    got = coordinator_model(load_config(overrides={"initial_model": str(path)}))
    assert got is not None and list(got) == ["fc2.weight", "fc1.weight"]
    for name, tensor in state.items():
        assert torch.equal(got[name], tensor)


def test_module_factory_model_is_seeded():
    first = coordinator_model(load_config(overrides={"model": "linear_factory:model", "seed": 3}))
    again = coordinator_model(load_config(overrides={"model": "linear_factory:model", "seed": 3}))
    other = coordinator_model(load_config(overrides={"model": "linear_factory:model", "seed": 4}))
    assert first is not None and again is not None and other is not None
    assert list(first) == ["weight", "bias"]
    assert torch.equal(first["weight"], again["weight"]) and not torch.equal(first["weight"], other["weight"])


def test_builtin_model_name_is_left_to_the_cli():
    assert coordinator_model(load_config()) is None


def test_bad_initial_model_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="does not exist") as info:
        coordinator_model(load_config(overrides={"initial_model": str(tmp_path / "missing.safetensors")}))
    assert info.value.key == "initial_model"
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="is not a readable safetensors file") as info:
        coordinator_model(load_config(overrides={"initial_model": str(junk)}))
    assert info.value.key == "initial_model"
    with pytest.raises(ConfigError) as info:
        coordinator_model(load_config(overrides={"model": "torch.nn:Identity"}))  # no parameters
    assert info.value.key == "model"


def test_run_coordinator_without_a_model_fails_before_listening(tmp_path):
    with pytest.raises(ConfigError, match="built-in model") as info:
        run_coordinator(load_config(overrides={"listen": "127.0.0.1:0", "out": str(tmp_path / "run")}))
    assert info.value.key == "model"
    assert not (tmp_path / "run").exists()
