"""The import-linter layer contracts hold, and they catch a module that breaks one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from import_tree import ROOT, build  # noqa: E402

LINT = [
    sys.executable,
    "-c",
    "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
]


def _lint(tree: Path) -> subprocess.CompletedProcess:
    # Run from inside the tree, so that its fedgrid/ is the one imported (not the checkout's).
    return subprocess.run(
        [*LINT, str(ROOT / "pyproject.toml")],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree)},
    )


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("layers"))


def test_the_package_keeps_every_contract(tree):
    result = _lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = len(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"])
    assert contracts >= 4 and f"Contracts: {contracts} kept, 0 broken." in result.stdout


LAYERS = "the layers of the package"


@pytest.mark.parametrize(
    "where,code,contract",
    [
        ("server/_probe.py", "import fedgrid.simulation.tasks\n", LAYERS),
        ("server/_probe.py", "from fedgrid.client import uplink\n", LAYERS),
        ("compression/_probe.py", "import grpc\n", "the math layers (aggregation, compression) do no I/O"),
        (
            "client/_probe.py",
            "import transformers\n",
            "transformers and peft (the hf and llm extras) are imported only",
        ),
        ("types.py", "from fedgrid.server import engine\n", LAYERS),
        ("config.py", "from fedgrid.ops import wan\n", LAYERS),
        ("_unlisted.py", "import fedgrid.errors\n", LAYERS),  # a module no layer names
        (
            "ops/launch.py",
            "from fedgrid.region import run_region\n",
            "fedgrid launch and fedgrid health run fedgrid processes",
        ),
        (
            "ops/health.py",
            "import fedgrid.server.service\n",
            "fedgrid launch and fedgrid health run fedgrid processes",
        ),
        ("cli/status.py", "import fedgrid.config\n", "fedgrid certs, health and status import no torch"),
        ("ops/pki.py", "import torch\n", "fedgrid certs, health and status import no torch"),
    ],
)
def test_a_module_that_breaks_a_layer_is_caught(tmp_path, where, code, contract):
    tree = build(tmp_path / "tree")
    module = tree / "fedgrid" / where
    text = module.read_text() if module.exists() else ""
    module.unlink(missing_ok=True)  # the tree links the checkout's file: change a copy, not the link
    module.write_text(text + "\n" + code)
    result = _lint(tree)
    assert result.returncode == 1, result.stdout
    report = " ".join(result.stdout.split())
    assert re.search(re.escape(contract) + r".{0,120}? BROKEN", report), report[-2000:]
