"""fedgrid: federated and geo-distributed training for PyTorch.

The public surface in one namespace: ``fedgrid.TorchClient``, ``fedgrid.run_simulation``,
``fedgrid.FedAvg``, ``fedgrid.load_config`` and the rest of ``__all__``.

Every name is imported on first access (PEP 562), not when ``fedgrid`` is imported. Python
runs this file before any ``fedgrid.*`` submodule, so an eager re-export would make
``import fedgrid.config`` load the coordinator, the client runtime and the simulation, with
torch and grpc, and the base modules would import the layers above them (the layer
contracts in ``pyproject.toml`` forbid that, and it makes import cycles). ``import fedgrid``
itself imports neither torch nor grpc.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("fedgrid")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+unknown"

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    # client SDK
    **dict.fromkeys(["Client", "FitOutput", "EvaluateOutput"], "fedgrid.client.api"),
    **dict.fromkeys(["run", "start", "ClientHandle", "RunSummary", "RpcFailed", "TaskReport", "ClientEvent"], "fedgrid.client.runtime"),
    **dict.fromkeys(["connect", "aconnect", "Session", "AsyncSession"], "fedgrid.client.session"),
    "ClientMonitor": "fedgrid.client.monitor",
    "TorchClient": "fedgrid.client.torch_client",
    # coordinator
    **dict.fromkeys(["Coordinator", "run_coordinator"], "fedgrid.server.app"),
    **dict.fromkeys(["RoundEngine"], "fedgrid.server.engine"),
    **dict.fromkeys(["Fleet", "RoundOutcome"], "fedgrid.server.fleet"),
    # simulation
    "run_simulation": "fedgrid.simulation.run",
    "InProcessFleet": "fedgrid.simulation.fleet",
    # strategies and aggregators
    **dict.fromkeys(
        [
            "Strategy", "Aggregator", "FedAvg", "FedOpt", "FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "FedProx",
            "Scaffold", "DiLoCo", "StreamingDiLoCo", "BlockCoordinate", "STRATEGIES", "build_strategy_from",
            "WeightedMean", "Mean", "Median", "TrimmedMean", "Krum", "MultiKrum", "NormClip", "CenteredClip",
        ],
        "fedgrid.aggregation",
    ),
    # codecs
    **dict.fromkeys(["Codec", "get_codec", "available_codecs"], "fedgrid.compression"),
    # configuration
    **dict.fromkeys(["Config", "load_config"], "fedgrid.config"),
    # what a client reports at Join
    **dict.fromkeys(["Capabilities", "CapabilityOverride"], "fedgrid.capabilities"),
    # types
    **dict.fromkeys(
        [
            "ModelState", "TensorSpec", "Scalar", "ClientInfo", "FitIns", "FitRes", "EvaluateIns", "EvaluateRes",
            "Failure", "RoundMetrics", "MessageIns", "MessageRes", "FIT", "EVALUATE", "TO_SERVER", "TO_ALL",
        ],
        "fedgrid.types",
    ),
    # errors
    **dict.fromkeys(
        [
            "FedgridError", "ResourceLimitError", "ConfigError", "InvalidUpdateError", "AuthenticationError",
            "PermissionDeniedError", "StaleTaskError", "DuplicateUpdateError", "PayloadTooLargeError",
            "RunFinishedError", "InterruptedRunError", "PKIError", "EnrollmentError", "CSRError",
            "EnrollmentNameError", "NonFiniteAggregateError", "SessionError",
        ],
        "fedgrid.errors",
    ),
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    """Imports the module defining ``name`` on first access and caches the value here.

    Raises:
        AttributeError: ``name`` is not public (neither in ``__all__`` nor a submodule).
    """
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fedgrid' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see; never executed
    from fedgrid.aggregation import (
        STRATEGIES, Aggregator, BlockCoordinate, CenteredClip, DiLoCo, FedAdagrad, FedAdam, FedAvg, FedAvgM, FedOpt,
        FedProx, FedYogi, Krum, Mean, Median, MultiKrum, NormClip, Scaffold, Strategy, StreamingDiLoCo, TrimmedMean,
        WeightedMean, build_strategy_from,
    )
    from fedgrid.client.api import Client, EvaluateOutput, FitOutput
    from fedgrid.client.monitor import ClientMonitor
    from fedgrid.client.runtime import ClientEvent, ClientHandle, RpcFailed, RunSummary, TaskReport, run, start
    from fedgrid.client.session import AsyncSession, Session, aconnect, connect
    from fedgrid.client.torch_client import TorchClient
    from fedgrid.compression import Codec, available_codecs, get_codec
    from fedgrid.config import Config, load_config
    from fedgrid.errors import (
        AuthenticationError, ConfigError, CSRError, DuplicateUpdateError, EnrollmentError, EnrollmentNameError,
        FedgridError, InterruptedRunError, InvalidUpdateError, NonFiniteAggregateError, PayloadTooLargeError,
        PermissionDeniedError, PKIError, ResourceLimitError, RunFinishedError, SessionError, StaleTaskError,
    )
    from fedgrid.server.app import Coordinator, run_coordinator
    from fedgrid.server.engine import RoundEngine
    from fedgrid.server.fleet import Fleet, RoundOutcome
    from fedgrid.simulation.fleet import InProcessFleet
    from fedgrid.simulation.run import run_simulation
    from fedgrid.types import (
        EVALUATE, FIT, TO_ALL, TO_SERVER, ClientInfo, EvaluateIns, EvaluateRes, Failure, FitIns, FitRes, MessageIns,
        MessageRes, ModelState, RoundMetrics, Scalar, TensorSpec,
    )
