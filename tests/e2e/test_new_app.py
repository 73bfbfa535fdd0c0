"""``fedgrid new NAME``: the template runs as written, in simulation and deployed, from the
folder that holds it, through the installed ``fedgrid`` console script (which, unlike
``python -m``, does not put the current directory on ``sys.path``): the script file run by this
interpreter, forked from the tests' zygote (``support/zygote.py``: ``sys.path[0]`` is the script's
folder, as in a process of its own)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedgrid.ops.new_app import TEMPLATES, AppNameError, create_app
from fedgrid.runlog import load_model, read_metrics

import zygote
from harness import child_env, wait_until

FEDGRID = Path(sys.executable).with_name("fedgrid")  # the console script of this environment


def _fedgrid(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return zygote.run(
        [sys.executable, str(FEDGRID), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
    )


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    assert FEDGRID.exists(), f"no fedgrid console script beside {sys.executable} (install the package)"
    made = _fedgrid(tmp_path, "new", "myapp", timeout=60)
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in (tmp_path / "myapp").iterdir()) == sorted(TEMPLATES)
    return tmp_path


def test_new_app_simulates_with_federated_accuracy(app_dir):
    sim = _fedgrid(app_dir, "simulate", "--config", "myapp/config.toml", "--rounds", "2", "--out", "runs/sim")
    assert sim.returncode == 0, sim.stdout + sim.stderr
    metrics = read_metrics(app_dir / "runs" / "sim")
    assert [m["round"] for m in metrics] == [1, 2]
    for m in metrics:
        assert (m["clients_ok"], m["clients_failed"], m["clients_evaluated"]) == (3, 0, 3)
        assert isinstance(m["accuracy"], float) and 0.0 < m["accuracy"] <= 1.0
    # Above chance (0.1) after two rounds of the 64-32-10 MLP at lr 0.1, and improving.
    assert metrics[1]["accuracy"] > max(metrics[0]["accuracy"], 0.2)
    assert "final test accuracy" in sim.stdout


def test_new_app_deploys_with_the_same_config_and_matches_the_simulation(app_dir):
    common = ["--config", "myapp/config.toml", "--rounds", "2", "--threads", "1"]
    out = app_dir / "runs" / "coord"
    coord = zygote.popen(
        [sys.executable, str(FEDGRID), "coordinator", *common, "--listen", "127.0.0.1:0", "--out", str(out)],
        cwd=app_dir,
        stdout=open(app_dir / "coord.log", "w"),
        stderr=subprocess.STDOUT,
        env=child_env(),
    )
    clients: list[subprocess.Popen] = []
    try:
        wait_until(
            lambda: (
                (out / "address").exists()
                and (out / "address").read_text().strip() != ""
                or coord.poll() is not None
            ),
            timeout=90,
            what="coordinator address",
        )
        assert coord.poll() is None, (app_dir / "coord.log").read_text()
        address = (out / "address").read_text().strip()
        clients = [
            zygote.popen(
                [
                    sys.executable,
                    str(FEDGRID),
                    "client",
                    "--coordinator",
                    address,
                    "--app",
                    "myapp.app:client",
                    "--partition",
                    f"{i}/3",
                    "--threads",
                    "1",
                ],
                cwd=app_dir,
                stdout=open(app_dir / f"c{i}.log", "w"),
                stderr=subprocess.STDOUT,
                env=child_env(),
            )
            for i in range(3)
        ]
        for i, c in enumerate(clients):
            assert c.wait(timeout=240) == 0, (app_dir / f"c{i}.log").read_text()
        assert coord.wait(timeout=60) == 0, (app_dir / "coord.log").read_text()
    finally:
        for p in [coord, *clients]:
            if p.poll() is None:
                p.kill()
    deployed = read_metrics(out)
    assert [(m["round"], m["clients_ok"], m["clients_evaluated"]) for m in deployed] == [(1, 3, 3), (2, 3, 3)]
    sim = _fedgrid(app_dir, "simulate", *common, "--engine", "sequential", "--out", "runs/sim")
    assert sim.returncode == 0, sim.stdout + sim.stderr
    simulated = load_model(app_dir / "runs" / "sim" / "model.safetensors")
    model = load_model(out / "model.safetensors")
    assert list(model) == list(simulated) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for name, tensor in simulated.items():
        assert torch.equal(model[name], tensor), name  # same engine and threads: the same bits
    assert [m["accuracy"] for m in read_metrics(app_dir / "runs" / "sim")] == [
        m["accuracy"] for m in deployed
    ]


def test_new_refuses_an_existing_directory_and_changes_nothing(tmp_path):
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "app.py").write_text("mine\n")
    with pytest.raises(AppNameError, match="already exists; fedgrid new overwrites nothing"):
        create_app("myapp", tmp_path)
    assert [p.name for p in (tmp_path / "myapp").iterdir()] == ["app.py"]
    assert (tmp_path / "myapp" / "app.py").read_text() == "mine\n"


@pytest.mark.parametrize(
    "name,problem",
    [
        ("my-app", "is not a valid Python identifier"),
        ("1app", "is not a valid Python identifier"),
        ("café", "is not a valid Python identifier"),
        ("class", "is a Python keyword"),
        ("json", "is already an importable module"),
        ("torch", "is already an importable module"),
    ],
)
def test_new_refuses_a_name_that_cannot_be_imported_as_the_app(tmp_path, name, problem):
    with pytest.raises(AppNameError, match=problem):
        create_app(name, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_cli_reports_a_bad_name_and_exits_nonzero(tmp_path, capsys, monkeypatch):
    from fedgrid.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["new", "my-app"]) == 1
    assert "app name 'my-app' is not a valid Python identifier" in capsys.readouterr().err
    assert main(["new", "good_app"]) == 0
    assert (tmp_path / "good_app" / "config.toml").read_text().count('"good_app.app:') == 2
