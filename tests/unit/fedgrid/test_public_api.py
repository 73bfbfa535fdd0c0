"""``import fedgrid``: the public surface, loaded lazily."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import fedgrid


def _in_fresh_interpreter(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


@pytest.mark.timeout(120)
def test_import_fedgrid_loads_neither_torch_nor_grpc_nor_the_layers():
    loaded = _in_fresh_interpreter(
        "import json, sys, fedgrid; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'grpc', 'fedgrid'))))"
    )
    assert loaded == ["fedgrid"]


@pytest.mark.timeout(120)
def test_a_base_module_does_not_pull_the_layers_above_it():
    loaded = _in_fresh_interpreter(
        "import json, sys, fedgrid.config; print(json.dumps(sorted(m for m in sys.modules if m.startswith('fedgrid.'))))"
    )
    assert not [m for m in loaded if m.startswith(("fedgrid.server", "fedgrid.client", "fedgrid.simulation", "fedgrid.proto"))]


def test_every_public_name_resolves_to_the_defining_object():
    from fedgrid.aggregation.base import Strategy
    from fedgrid.client.session import aconnect, connect
    from fedgrid.client.torch_client import TorchClient
    from fedgrid.server.app import run_coordinator
    from fedgrid.simulation.run import run_simulation

    for name in fedgrid.__all__:
        assert getattr(fedgrid, name) is not None, name
    assert fedgrid.Strategy is Strategy and fedgrid.TorchClient is TorchClient
    assert fedgrid.run_coordinator is run_coordinator and fedgrid.run_simulation is run_simulation
    assert fedgrid.connect is connect and fedgrid.aconnect is aconnect
    assert issubclass(fedgrid.ConfigError, fedgrid.FedgridError)
    assert fedgrid.FedAvg.__mro__[1:].count(fedgrid.Strategy) == 1


def test_dir_lists_the_public_names():
    assert set(fedgrid.__all__) <= set(dir(fedgrid))
    assert {"Client", "TorchClient", "run", "start", "run_coordinator", "Coordinator", "run_simulation", "Strategy",
            "build_strategy_from", "FedAvg", "DiLoCo", "Config", "load_config", "FitIns", "FitRes", "ModelState",
            "FedgridError", "__version__"} <= set(fedgrid.__all__)


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    assert fedgrid.__version__ == version("fedgrid")


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        fedgrid.Trainer  # noqa: B018
