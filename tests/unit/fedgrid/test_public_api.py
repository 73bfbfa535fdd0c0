"""``import fedgrid``: the public surface, loaded lazily."""

from __future__ import annotations

import pytest

import fedgrid


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
