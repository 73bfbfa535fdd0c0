"""Strategies: what each round asks of whom, and how results become the next global state.

The built-in ones (``STRATEGIES`` by name, ``build_strategy_from`` for a config), the
``Strategy`` ABC to write another, and the server optimizers that FedOpt and DiLoCo step.
Names are imported on first access (``fedgrid.lazy``); they are defined in ``fedgrid.aggregation``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedgrid.lazy import exports

__all__ = [
    "Strategy",
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
    "strategy_options",
    "ServerOptimizer",
    "ServerSGD",
    "ServerAdam",
    "ServerYogi",
    "ServerAdagrad",
]

__getattr__, __dir__ = exports(__name__, dict.fromkeys(__all__, "fedgrid.aggregation"), globals_=globals())

if TYPE_CHECKING:  # what type checkers and IDEs see; never executed
    from fedgrid.aggregation import (
        STRATEGIES,
        BlockCoordinate,
        DiLoCo,
        FedAdagrad,
        FedAdam,
        FedAvg,
        FedAvgM,
        FedOpt,
        FedProx,
        FedYogi,
        Scaffold,
        ServerAdagrad,
        ServerAdam,
        ServerOptimizer,
        ServerSGD,
        ServerYogi,
        Strategy,
        StreamingDiLoCo,
        build_strategy_from,
        strategy_options,
    )
