"""Unit tests of ``fedgrid.runlog``: config.toml, metrics.jsonl and model.safetensors."""

from __future__ import annotations

import json
import math
from collections import OrderedDict

import pytest
import tomllib
import torch

from fedgrid.config import load_config
from fedgrid.runlog import RunWriter, load_model, read_metrics, to_toml
from fedgrid.types import RoundMetrics


def test_config_toml_parses_back_to_same_values(tmp_path):
    config = load_config(overrides={"rounds": 3, "lr": 0.015, "out": str(tmp_path), "listen": "127.0.0.1:0"})
    values = {**config.to_dict(), "note": None, "flag": True, "off": False}
    RunWriter(tmp_path, values)
    parsed = tomllib.loads((tmp_path / "config.toml").read_text())
    assert parsed == {k: v for k, v in values.items() if v is not None}
    assert "note" not in parsed
    assert {k: type(v) for k, v in parsed.items()} == {k: type(v) for k, v in values.items() if v is not None}
    assert (
        load_config(overrides={k: parsed[k] for k in config.to_dict() if k in parsed}) == config
    )  # absent: None


def test_written_config_loads_as_config(tmp_path):
    config = load_config(overrides={"rounds": 4, "partition": "iid", "out": str(tmp_path / "run")})
    writer = RunWriter(config.out, config.to_dict())
    assert load_config(writer.dir / "config.toml") == config


@pytest.mark.parametrize(
    "text",
    [
        'quote " and backslash \\ ',
        "new\nline\ttab",
        "caf\u00e9 \u4e2d\u6587",
        "del\x7f nul\x00",
        "",
        "a = 1 # not a comment",
    ],
)
def test_to_toml_strings_roundtrip(text):
    assert tomllib.loads(to_toml({"s": text})) == {"s": text}


def test_to_toml_numbers_roundtrip():
    values = {
        "i": -(2**63),
        "j": 2**63 - 1,
        "f": 0.1,
        "g": 1e300,
        "h": -0.0,
        "inf": math.inf,
        "ninf": -math.inf,
    }
    parsed = tomllib.loads(to_toml(values))
    assert parsed == values
    assert math.copysign(1.0, parsed["h"]) == -1.0
    assert math.isnan(tomllib.loads(to_toml({"n": math.nan}))["n"])


def test_to_toml_non_bmp_string_roundtrip():
    text = "run-\U0001f680"
    assert tomllib.loads(to_toml({"out": text})) == {"out": text}


def _metrics(r: int, **extra: float) -> RoundMetrics:
    return RoundMetrics(
        round=r,
        loss=0.5 / r,
        accuracy=None if r == 1 else 0.9,
        bytes_up=100 * r,
        bytes_down=200 * r,
        wall_s=1.23456789,
        clients_ok=3,
        clients_failed=r - 1,
        extra=extra,
    )


def test_metrics_jsonl_lines(tmp_path):
    writer = RunWriter(tmp_path, {"rounds": 2})
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    writer.write_round(_metrics(1))
    writer.write_round(_metrics(2, train_loss=0.75))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first == {
        "round": 1,
        "loss": 0.5,
        "accuracy": None,
        "bytes_up": 100,
        "bytes_down": 200,
        "wall_s": 1.234568,
        "clients_ok": 3,
        "clients_failed": 0,
    }
    assert second["round"] == 2 and second["loss"] == 0.25 and second["accuracy"] == 0.9
    assert second["clients_failed"] == 1 and second["train_loss"] == 0.75
    assert list(second)[:8] == [
        "round",
        "loss",
        "accuracy",
        "bytes_up",
        "bytes_down",
        "wall_s",
        "clients_ok",
        "clients_failed",
    ]
    assert read_metrics(tmp_path) == [first, second]


def _strict(text: str) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_metrics_jsonl_is_strict_json_whatever_the_figures(tmp_path):
    writer = RunWriter(tmp_path, {})
    writer.write_round(_metrics(1, compute_s=math.inf, utilization=math.nan, nested=[1.0, -math.inf]))
    writer.reset_metrics([*read_metrics(tmp_path), {"round": 2, "loss": math.nan}])
    rows = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["compute_s"] is None and rows[0]["utilization"] is None
    assert rows[0]["nested"] == [1.0, None] and rows[0]["clients_ok"] == 3
    assert rows[1] == {"round": 2, "loss": None}


def test_reset_metrics_replaces_the_file(tmp_path):
    RunWriter(tmp_path, {}).write_round(_metrics(1))
    writer = RunWriter(tmp_path, {})  # a resumed coordinator reopens the directory: nothing lost yet
    assert [m["round"] for m in read_metrics(tmp_path)] == [1]
    writer.reset_metrics([])
    assert read_metrics(tmp_path) == []
    writer.reset_metrics([_metrics(1).to_json(), _metrics(2).to_json()])
    assert [m["round"] for m in read_metrics(tmp_path)] == [1, 2]


def test_model_roundtrip(tmp_path):
    gen = torch.Generator().manual_seed(0)
    state = OrderedDict(
        w=torch.randn(4, 3, generator=gen),
        t=torch.randn(3, 4, generator=gen).t(),  # non-contiguous
        h=torch.randn(5, generator=gen).to(torch.bfloat16),
        n=torch.tensor(7, dtype=torch.int64),
        e=torch.empty(0, 2),
    )
    writer = RunWriter(tmp_path / "nested" / "run", {})
    path = writer.write_model(state)
    assert path == tmp_path / "nested" / "run" / "model.safetensors"
    assert not list(path.parent.glob("*.tmp"))
    loaded = load_model(path)
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert torch.equal(loaded[name], tensor)
    # writing again replaces the file
    writer.write_model(OrderedDict(w=torch.zeros(1)))
    assert list(load_model(path)) == ["w"]


def test_model_file_keeps_the_models_tensor_order(tmp_path):
    from collections import OrderedDict

    from fedgrid.runlog import RunWriter, load_model

    state = OrderedDict(
        [("z.weight", torch.ones(2)), ("a.bias", torch.zeros(3)), ("m.steps", torch.tensor(4))]
    )
    path = RunWriter(tmp_path, {"rounds": 1}).write_model(state)
    loaded = load_model(path)
    assert list(loaded) == ["z.weight", "a.bias", "m.steps"]  # not safetensors' sorted order
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor)
