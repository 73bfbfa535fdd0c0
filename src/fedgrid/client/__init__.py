"""Client SDK: implement or build a ``Client`` and ``run_client`` it against a coordinator, or
``connect`` a program that owns its training loop (``aconnect`` for asyncio)."""

from fedgrid.client.api import Client, EvaluateOutput, FitOutput
from fedgrid.client.runtime import (
    ClientHandle,
    CoordinatorLost,
    CoordinatorUnreachable,
    IdentityConflict,
    MisconfiguredConnection,
    RpcFailed,
    RunSummary,
    TaskReport,
    run_client,
    start_client,
)
from fedgrid.client.session import AsyncSession, Delivery, Session, Task, aconnect, connect
from fedgrid.client.torch_client import TorchClient

__all__ = [
    "Client",
    "EvaluateOutput",
    "FitOutput",
    "TorchClient",
    "ClientHandle",
    "RunSummary",
    "RpcFailed",
    "CoordinatorUnreachable",
    "MisconfiguredConnection",
    "CoordinatorLost",
    "IdentityConflict",
    "run_client",
    "start_client",
    "TaskReport",
    "connect",
    "aconnect",
    "Session",
    "Delivery",
    "AsyncSession",
    "Task",
]
