"""Experiment trackers (``fedgrid.trackers``): TensorBoard's event files read back hold
``metrics.jsonl``'s numbers; MLflow (a fake ``mlflow`` module: no MLflow is installed
here) gets the config as params and each round with ``step=round``; a missing package is
a ConfigError before any work; a tracker that fails while logging never stops training."""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import tomllib
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fedgrid.cli import main
from fedgrid.config import load_config
from fedgrid.errors import ConfigError
from fedgrid.runlog import RunWriter, read_metrics
from fedgrid.trackers import parse_trackers, scalars
from fedgrid.types import RoundMetrics


def _simulate(out: Path, *flags: str) -> list[dict]:
    assert (
        main(
            ["simulate", "--rounds", "3", "--threads", "1", "--progress", "false", "--out", str(out), *flags]
        )
        == 0
    )
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [1, 2, 3]
    return rows


def _tensorboard(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _float32(value: object) -> float:
    return float(np.float32(value))  # TensorBoard stores scalars as float32


class FakeMLflow(types.ModuleType):
    """The fluent calls of MLflow's API that the tracker uses, recorded."""

    def __init__(self, fail_metrics: bool = False) -> None:
        super().__init__("mlflow")
        self.__spec__ = importlib.machinery.ModuleSpec("mlflow", None)  # find_spec reads it
        self.calls: list[tuple[str, object]] = []
        self.active: object = None
        self.fail_metrics = fail_metrics

    def active_run(self):
        return self.active

    def start_run(self, run_name=None, nested=False):
        self.calls.append(("start_run", {"run_name": run_name, "nested": nested}))
        self.active = object()
        return self.active

    def log_params(self, params):
        assert len(params) <= 100  # MLflow's limit per call
        self.calls.append(("log_params", dict(params)))

    def log_metrics(self, metrics, step=None):
        if self.fail_metrics:
            raise ConnectionError("tracking server unreachable")
        self.calls.append(("log_metrics", (step, dict(metrics))))

    def end_run(self):
        self.calls.append(("end_run", None))
        self.active = None

    def of(self, name: str) -> list:
        return [args for call, args in self.calls if call == name]


def test_tensorboard_scalars_equal_metrics_jsonl(tmp_path):
    rows = _simulate(tmp_path / "run", "--tracker", "tensorboard")
    logged = _tensorboard(tmp_path / "run")
    assert (
        set(logged)
        == set(scalars(rows[0]))
        >= {"loss", "accuracy", "bytes_up", "bytes_down", "wall_s", "clients_ok", "clients_failed"}
    )
    for tag, points in logged.items():
        assert points == [(r["round"], _float32(r[tag])) for r in rows], tag
    assert tomllib.loads((tmp_path / "run" / "config.toml").read_text())["tracker"] == "tensorboard"


def test_tensorboard_resumed_run_replaces_the_rounds_after_the_committed_one(tmp_path):
    def metrics(r: int, loss: float) -> RoundMetrics:
        return RoundMetrics(
            round=r,
            loss=loss,
            accuracy=None,
            bytes_up=10 * r,
            bytes_down=20 * r,
            wall_s=0.5,
            clients_ok=2,
            clients_failed=0,
        )

    config = {"tracker": "tensorboard"}
    first = RunWriter(tmp_path, config)
    first.reset_metrics([])
    for r in (1, 2, 3):
        first.write_round(metrics(r, 1.0 / r))
    first.close()  # round 3 was written but, say, never checkpointed: a restart redoes it
    second = RunWriter(tmp_path, config)
    second.reset_metrics([metrics(1, 1.0).to_json(), metrics(2, 0.5).to_json()])
    second.write_round(metrics(3, 0.25))
    second.write_round(metrics(4, 0.125))
    second.close()
    logged = _tensorboard(tmp_path)
    assert logged["loss"] == [(1, 1.0), (2, 0.5), (3, 0.25), (4, 0.125)]  # round 3 once, the redone value
    assert "accuracy" not in logged  # None is not logged
    assert [r["loss"] for r in read_metrics(tmp_path)] == [1.0, 0.5, 0.25, 0.125]


def test_mlflow_gets_config_params_and_every_round(tmp_path, monkeypatch):
    fake = FakeMLflow()
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    rows = _simulate(tmp_path / "mlrun", "--tracker", "mlflow,tensorboard")
    assert fake.of("start_run") == [{"run_name": "mlrun", "nested": False}]
    params = {k: v for chunk in fake.of("log_params") for k, v in chunk.items()}
    recorded = tomllib.loads((tmp_path / "mlrun" / "config.toml").read_text())
    recorded.pop("environment")
    assert params == recorded  # the resolved config, as config.toml has it
    assert fake.of("log_metrics") == [(r["round"], scalars(r)) for r in rows]
    assert [c for c, _ in fake.calls][-1] == "end_run"
    assert _tensorboard(tmp_path / "mlrun")["loss"] == [
        (r["round"], _float32(r["loss"])) for r in rows
    ]  # both trackers fed


def test_mlflow_run_nests_in_the_callers_and_resume_logs_the_committed_rounds(tmp_path, monkeypatch):
    fake = FakeMLflow()
    fake.active = object()  # the embedding program's own run
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    rows = [
        RoundMetrics(
            round=r,
            loss=float("nan") if r == 2 else 0.5,
            accuracy=0.75,
            bytes_up=1,
            bytes_down=2,
            wall_s=0.1,
            clients_ok=1,
            clients_failed=0,
            extra={"round_failed": 1} if r == 2 else {},
        ).to_json()
        for r in (1, 2)
    ]
    writer = RunWriter(tmp_path / "resumed", {"tracker": "mlflow", "rounds": 3})
    writer.reset_metrics(rows)
    assert fake.of("start_run") == [{"run_name": "resumed", "nested": True}]
    assert fake.of("log_params") == [{"tracker": "mlflow", "rounds": 3}]
    # NaN stays in metrics.jsonl, not in MLflow.
    assert [step for step, _ in fake.of("log_metrics")] == [1, 2] and "loss" not in fake.of("log_metrics")[1][
        1
    ]
    assert fake.of("log_metrics")[1][1]["round_failed"] == 1.0


def test_a_failing_tracker_is_logged_once_and_training_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "mlflow", FakeMLflow(fail_metrics=True))
    with caplog.at_level(logging.WARNING, logger="fedgrid.trackers"):
        rows = _simulate(tmp_path / "run", "--tracker", "mlflow")
    assert len(rows) == 3 and (tmp_path / "run" / "model.safetensors").is_file()
    records = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "fedgrid.trackers"]
    assert records == [
        (
            "ERROR",
            "tracker mlflow: logging round 1 failed; training goes on and metrics.jsonl keeps every round "
            "(later errors of this tracker are counted, not logged)",
        ),
        ("WARNING", "tracker mlflow: 3 call(s) failed in this run; metrics.jsonl has every round"),
    ]


@pytest.mark.parametrize("name,blocked", [("mlflow", ["mlflow"]), ("tensorboard", ["tensorboard"])])
def test_missing_package_is_a_config_error_naming_the_extra(tmp_path, monkeypatch, capsys, name, blocked):
    for module in blocked:
        monkeypatch.setitem(sys.modules, module, None)  # import (and find_spec) of it fails
    expected = f"config key 'tracker': {name} needs the {name} package, which is not installed: pip install 'fedgrid[{name}]'"
    with pytest.raises(ConfigError) as exc:
        load_config(overrides={"tracker": name})
    assert str(exc.value) == expected
    assert main(["simulate", "--rounds", "1", "--tracker", name, "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == f"fedgrid: error: {expected}"
    assert not (tmp_path / "run").exists()  # failed before any work


def test_tensorboard_import_failure_at_start_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # installed, but its import fails
    with pytest.raises(ConfigError, match=r"pip install 'fedgrid\[tensorboard\]'"):
        RunWriter(tmp_path / "run", {"tracker": "tensorboard"})
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "spec,problem",
    [
        ("wandb", "unknown tracker 'wandb' (known: tensorboard, mlflow)"),
        ("tensorboard, tensorboard", "a tracker is named twice in 'tensorboard, tensorboard'"),
    ],
)
def test_bad_tracker_names(spec, problem):
    with pytest.raises(ConfigError) as exc:
        load_config(overrides={"tracker": spec})
    assert str(exc.value) == f"config key 'tracker': {problem}"


def test_tracker_specs_parse():
    assert parse_trackers("") == ()
    assert parse_trackers(" tensorboard ,") == ("tensorboard",)
