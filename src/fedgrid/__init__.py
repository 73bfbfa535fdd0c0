"""fedgrid: federated and geo-distributed training for PyTorch.

The names most programs need, in one namespace: a client (``TorchClient``, or ``Client`` to
write one) joined with ``run_client`` / ``start_client`` / ``connect``; a coordinator
(``run_coordinator``); a whole federation in one process (``run_simulation``); a ``Config``.
The rest lives in namespaces: ``fedgrid.strategies``, ``fedgrid.aggregators``,
``fedgrid.codecs``, ``fedgrid.errors`` and ``fedgrid.types``.

Every name is imported on first access (``fedgrid.lazy``), so ``import fedgrid`` imports
neither torch nor grpc, and ``import fedgrid.config`` does not load the layers above it. The
names that lived here before the namespaces still work for one release, with a
``DeprecationWarning`` that names their new home.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedgrid.lazy import exports

# Public name -> the module that defines it ("module:attribute" where the names differ).
_EXPORTS: dict[str, str] = {
    "__version__": "fedgrid.release:VERSION",  # the installed package's version
    # writing and running a client
    **dict.fromkeys(["Client", "FitOutput", "EvaluateOutput"], "fedgrid.client.api"),
    "TorchClient": "fedgrid.client.torch_client",
    "run_client": "fedgrid.client.runtime",
    "start_client": "fedgrid.client.runtime",
    "connect": "fedgrid.client.session",
    # a coordinator, a simulation
    **dict.fromkeys(["Coordinator", "run_coordinator"], "fedgrid.server.app"),
    "run_simulation": "fedgrid.simulation.run",
    # what they are configured with and exchange
    **dict.fromkeys(["Config", "load_config"], "fedgrid.config"),
    "Strategy": "fedgrid.aggregation.base",
    "Codec": "fedgrid.compression.base",
    "ModelState": "fedgrid.types",
    "FedgridError": "fedgrid.errors",
}

_MOVED: dict[str, str] = {
    "run": "fedgrid.run_client",
    "start": "fedgrid.start_client",
    **{
        n: f"fedgrid.client.runtime.{n}"
        for n in ["ClientHandle", "RunSummary", "RpcFailed", "TaskReport", "ClientEvent"]
    },
    **{n: f"fedgrid.client.session.{n}" for n in ["aconnect", "Session", "AsyncSession"]},
    "ClientMonitor": "fedgrid.client.monitor.ClientMonitor",
    "RoundEngine": "fedgrid.server.engine.RoundEngine",
    **{n: f"fedgrid.server.fleet.{n}" for n in ["Fleet", "RoundOutcome"]},
    "InProcessFleet": "fedgrid.simulation.fleet.InProcessFleet",
    **{
        n: f"fedgrid.strategies.{n}"
        for n in [
            "FedAvg",
            "FedOpt",
            "FedAvgM",
            "FedAdam",
            "FedYogi",
            "FedAdagrad",
            "FedProx",
            "Scaffold",
            "DiLoCo",
            "StreamingDiLoCo",
            "BlockCoordinate",
            "STRATEGIES",
            "build_strategy_from",
        ]
    },
    **{
        n: f"fedgrid.aggregators.{n}"
        for n in [
            "Aggregator",
            "WeightedMean",
            "Mean",
            "Median",
            "TrimmedMean",
            "Krum",
            "MultiKrum",
            "NormClip",
            "CenteredClip",
        ]
    },
    **{n: f"fedgrid.codecs.{n}" for n in ["get_codec", "available_codecs"]},
    **{n: f"fedgrid.capabilities.{n}" for n in ["Capabilities", "CapabilityOverride"]},
    **{
        n: f"fedgrid.types.{n}"
        for n in [
            "TensorSpec",
            "Scalar",
            "ClientInfo",
            "FitIns",
            "FitRes",
            "EvaluateIns",
            "EvaluateRes",
            "Failure",
            "RoundMetrics",
            "MessageIns",
            "MessageRes",
            "FIT",
            "EVALUATE",
            "TO_SERVER",
            "TO_ALL",
        ]
    },
    **{
        n: f"fedgrid.errors.{n}"
        for n in [
            "ResourceLimitError",
            "ConfigError",
            "InvalidUpdateError",
            "AuthenticationError",
            "PermissionDeniedError",
            "StaleTaskError",
            "DuplicateUpdateError",
            "PayloadTooLargeError",
            "RunFinishedError",
            "InterruptedRunError",
            "PKIError",
            "EnrollmentError",
            "CSRError",
            "EnrollmentNameError",
            "NonFiniteAggregateError",
            "SessionError",
        ]
    },
}

__all__ = [*_EXPORTS]

__getattr__, __dir__ = exports("fedgrid", _EXPORTS, deprecated=_MOVED, globals_=globals())

if TYPE_CHECKING:  # what type checkers and IDEs see; never executed
    from fedgrid.aggregation.base import Strategy
    from fedgrid.client.api import Client, EvaluateOutput, FitOutput
    from fedgrid.client.runtime import run_client, start_client
    from fedgrid.client.session import connect
    from fedgrid.client.torch_client import TorchClient
    from fedgrid.compression.base import Codec
    from fedgrid.config import Config, load_config
    from fedgrid.errors import FedgridError
    from fedgrid.release import VERSION as __version__
    from fedgrid.server.app import Coordinator, run_coordinator
    from fedgrid.simulation.run import run_simulation
    from fedgrid.types import ModelState
