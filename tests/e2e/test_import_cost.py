"""``import fedgrid`` in a fresh interpreter: the public surface is lazy, and a base module does not
pull the layers above it (each test starts a Python process)."""

from __future__ import annotations

import json
import subprocess
import sys


def _in_fresh_interpreter(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout)


def test_import_fedgrid_loads_neither_torch_nor_grpc_nor_the_layers():
    loaded = _in_fresh_interpreter(
        "import json, sys, fedgrid; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'grpc', 'fedgrid'))))"
    )
    assert loaded == ["fedgrid", "fedgrid.lazy"]  # the lazy re-export mechanism, nothing else


def test_a_base_module_does_not_pull_the_layers_above_it():
    loaded = _in_fresh_interpreter(
        "import json, sys, fedgrid.config; print(json.dumps(sorted(m for m in sys.modules if m.startswith('fedgrid.'))))"
    )
    assert not [
        m
        for m in loaded
        if m.startswith(("fedgrid.server", "fedgrid.client", "fedgrid.simulation", "fedgrid.proto"))
    ]


def test_transformers_is_imported_only_to_build_an_hf_model():
    loaded = _in_fresh_interpreter(
        "import json, sys, fedgrid.cli.simulate, fedgrid.cli.client, fedgrid.cli.coordinator, fedgrid.simulation.run;"
        "from fedgrid.simulation.tasks import build_model; build_model('shakespeare', 'gpt:dim=32');"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'huggingface_hub'))))"
    )
    assert loaded == []  # the hf extra is optional: only --model hf:PATH imports it
