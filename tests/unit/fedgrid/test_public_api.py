"""``import fedgrid``: the public surface, loaded lazily."""

from __future__ import annotations

import pytest

import fedgrid


def test_every_public_name_resolves_to_the_defining_object():
    from fedgrid.aggregation.base import Strategy
    from fedgrid.client.runtime import run_client as run
    from fedgrid.client.runtime import start_client as start
    from fedgrid.client.session import connect
    from fedgrid.client.torch_client import TorchClient
    from fedgrid.compression.base import Codec
    from fedgrid.server.serve import run_coordinator
    from fedgrid.simulation.run import run_simulation

    for name in fedgrid.__all__:
        assert getattr(fedgrid, name) is not None, name
    assert fedgrid.Strategy is Strategy and fedgrid.TorchClient is TorchClient and fedgrid.Codec is Codec
    assert fedgrid.run_coordinator is run_coordinator and fedgrid.run_simulation is run_simulation
    assert fedgrid.run_client is run and fedgrid.start_client is start and fedgrid.connect is connect


def test_the_top_level_is_small_and_the_rest_lives_in_namespaces():
    import fedgrid.aggregators
    import fedgrid.codecs
    import fedgrid.strategies
    from fedgrid.aggregation import FedAvg, Krum
    from fedgrid.compression import Int8Codec

    assert len(fedgrid.__all__) <= 20
    assert {
        "Client",
        "TorchClient",
        "run_client",
        "start_client",
        "connect",
        "run_coordinator",
        "Coordinator",
        "run_simulation",
        "Config",
        "load_config",
        "Strategy",
        "Codec",
        "ModelState",
        "FedgridError",
        "__version__",
    } <= set(fedgrid.__all__)
    assert set(fedgrid.__all__) <= set(dir(fedgrid))
    assert (
        fedgrid.strategies.FedAvg is FedAvg
        and fedgrid.aggregators.Krum is Krum
        and fedgrid.codecs.Int8Codec is Int8Codec
    )
    for namespace in (fedgrid.strategies, fedgrid.aggregators, fedgrid.codecs):
        for name in namespace.__all__:
            assert getattr(namespace, name) is not None, f"{namespace.__name__}.{name}"
        assert set(namespace.__all__) <= set(dir(namespace))
    assert issubclass(fedgrid.errors.ConfigError, fedgrid.FedgridError)
    assert fedgrid.strategies.FedAvg.__mro__[1:].count(fedgrid.Strategy) == 1


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    assert fedgrid.__version__ == version("fedgrid")


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        fedgrid.Trainer  # noqa: B018


@pytest.mark.parametrize(
    "module,old",
    [
        ("fedgrid", "FedAvg"),
        ("fedgrid", "run"),
        ("fedgrid", "InProcessFleet"),
        ("fedgrid.client", "run"),
        ("fedgrid.client.runtime", "start"),
        ("fedgrid.client.algorithms", "FedAvg"),
        ("fedgrid.simulation.tasks", "get_task"),
        ("fedgrid.aggregation.updates", "apply_delta"),
    ],
)
def test_the_names_of_before_the_namespaces_are_gone(module, old):
    import importlib

    with pytest.raises(AttributeError, match=f"no attribute '{old}'"):
        getattr(importlib.import_module(module), old)


def test_the_old_home_of_remote_fleet_is_gone():
    import importlib

    with pytest.raises(ModuleNotFoundError, match="fedgrid.server.grpc_fleet"):
        importlib.import_module("fedgrid.server.grpc_fleet")


def test_the_package_keeps_no_deprecated_alias():
    from pathlib import Path

    package = Path(fedgrid.__file__).parent
    warned = [p.relative_to(package) for p in package.rglob("*.py") if "DeprecationWarning" in p.read_text()]
    assert warned == []
