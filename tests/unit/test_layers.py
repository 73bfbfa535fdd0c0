"""The import-linter layer contracts hold, and they catch a module that breaks one."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from import_tree import ROOT, build  # noqa: E402

LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]


def _lint(tree: Path) -> subprocess.CompletedProcess:
    # Run from inside the tree, so that its fedgrid/ is the one imported (not the checkout's).
    return subprocess.run([*LINT, str(ROOT / "pyproject.toml")], cwd=tree, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree)})


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("layers"))


@pytest.mark.timeout(180)
def test_the_package_keeps_every_contract(tree):
    result = _lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = len(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"])
    assert contracts >= 7 and f"Contracts: {contracts} kept, 0 broken." in result.stdout


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "where,code,contract",
    [
        ("server", "import fedgrid.simulation.tasks\n", "server and client import neither simulation nor the CLI"),
        ("server", "from fedgrid.client import uplink\n", "server and client never import each other"),
        ("compression", "import grpc\n", "the math layers (aggregation, compression) do no I/O"),
        ("fedgrid", "from fedgrid.server import engine\n", "the base modules import no layer above them"),
        ("fedgrid.launch", "from fedgrid.region import run_region\n", "fedgrid launch and fedgrid health run fedgrid processes"),
        ("fedgrid.health", "import fedgrid.server.service\n", "fedgrid launch and fedgrid health run fedgrid processes"),
    ],
)
def test_a_module_that_breaks_a_layer_is_caught(tmp_path, where, code, contract):
    tree = build(tmp_path / "tree")
    if where == "fedgrid" or where.startswith("fedgrid."):  # a module importing upwards: change it (a copy, not the link)
        module = tree / "fedgrid" / f"{where.partition('.')[2] or 'types'}.py"
        text = module.read_text()
        module.unlink()
        module.write_text(text + "\n" + code)
    else:
        (tree / "fedgrid" / where / "_probe.py").write_text(code)
    result = _lint(tree)
    assert result.returncode == 1, result.stdout
    report = " ".join(result.stdout.split())
    assert re.search(re.escape(contract) + r".{0,120}? BROKEN", report), report[-2000:]
