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
    from fedgrid.server.app import run_coordinator
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


@pytest.mark.parametrize(
    "old,new",
    [
        ("FedAvg", "fedgrid.strategies.FedAvg"),
        ("run", "fedgrid.run_client"),
        ("start", "fedgrid.start_client"),
        ("Median", "fedgrid.aggregators.Median"),
        ("get_codec", "fedgrid.codecs.get_codec"),
        ("FitIns", "fedgrid.types.FitIns"),
        ("ConfigError", "fedgrid.errors.ConfigError"),
        ("InProcessFleet", "fedgrid.simulation.fleet.InProcessFleet"),
    ],
)
def test_an_old_top_level_name_works_for_one_release_with_a_warning_naming_its_home(old, new):
    import importlib

    module, _, attribute = new.rpartition(".")
    with pytest.warns(
        DeprecationWarning, match=f"fedgrid.{old} is deprecated .*use {new.replace('.', '[.]')}"
    ):
        value = getattr(fedgrid, old)
    assert value is getattr(importlib.import_module(module), attribute)
    assert old not in fedgrid.__all__


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    assert fedgrid.__version__ == version("fedgrid")


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        fedgrid.Trainer  # noqa: B018


@pytest.mark.parametrize("module", ["fedgrid.client", "fedgrid.client.runtime"])
def test_run_and_start_work_for_one_release_as_run_client_and_start_client(module):
    import importlib

    from fedgrid.client.runtime import run_client, start_client

    namespace = importlib.import_module(module)
    with pytest.warns(
        DeprecationWarning, match="runtime.run is deprecated .*use fedgrid.client.runtime.run_client"
    ):
        assert namespace.run is run_client
    with pytest.warns(
        DeprecationWarning, match="runtime.start is deprecated .*use fedgrid.client.runtime.start_client"
    ):
        assert namespace.start is start_client


def test_renamed_helpers_work_for_one_release_with_a_warning():
    import importlib

    from fedgrid.aggregation.updates import add_update
    from fedgrid.server.remote_fleet import RemoteFleet

    updates = importlib.import_module("fedgrid.aggregation.updates")
    with pytest.warns(
        DeprecationWarning,
        match="updates.apply_delta is deprecated .*use fedgrid.aggregation.updates.add_update",
    ):
        assert updates.apply_delta is add_update
    with pytest.warns(
        DeprecationWarning, match="fedgrid.server.grpc_fleet is deprecated .*use fedgrid.server.remote_fleet"
    ):
        old = importlib.import_module("fedgrid.server.grpc_fleet")
        old = importlib.reload(old)  # the warning comes on import: once per process, so import it afresh
    with pytest.warns(DeprecationWarning, match="GrpcFleet is deprecated"):
        assert old.GrpcFleet is RemoteFleet
