"""fedgrid: federated and geo-distributed training for PyTorch.

The names most programs need, in one namespace: a client (``TorchClient``, or ``Client`` to
write one) joined with ``run_client`` / ``start_client`` / ``connect``; a coordinator
(``run_coordinator``); a whole federation in one process (``run_simulation``); a ``Config``.
The rest lives in namespaces: ``fedgrid.strategies``, ``fedgrid.aggregators``,
``fedgrid.codecs``, ``fedgrid.errors`` and ``fedgrid.types``.

Every name is imported on first access (``fedgrid.lazy``), so ``import fedgrid`` imports
neither torch nor grpc, and ``import fedgrid.config`` does not load the layers above it.
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
    **dict.fromkeys(["Coordinator", "run_coordinator"], "fedgrid.server.serve"),
    "run_simulation": "fedgrid.simulation.run",
    # what they are configured with and exchange
    **dict.fromkeys(["Config", "load_config"], "fedgrid.config"),
    "Strategy": "fedgrid.aggregation.base",
    "Codec": "fedgrid.compression.base",
    "ModelState": "fedgrid.types",
    "FedgridError": "fedgrid.errors",
}

__all__ = [*_EXPORTS]

__getattr__, __dir__ = exports("fedgrid", _EXPORTS, globals_=globals())

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
    from fedgrid.server.serve import Coordinator, run_coordinator
    from fedgrid.simulation.run import run_simulation
    from fedgrid.types import ModelState
