"""Client SDK: implement or build a ``Client`` and ``run`` it against a coordinator, or
``connect`` a program that owns its training loop (``aconnect`` for asyncio)."""

from fedgrid.client.api import Client, EvaluateOutput, FitOutput
from fedgrid.client.runtime import ClientHandle, CoordinatorUnreachable, RunSummary, RpcFailed, TaskReport, run, start
from fedgrid.client.session import AsyncSession, Session, Task, aconnect, connect
from fedgrid.client.torch_client import TorchClient

__all__ = ["Client", "EvaluateOutput", "FitOutput", "TorchClient", "ClientHandle", "RunSummary", "RpcFailed", "CoordinatorUnreachable", "run", "start",
           "TaskReport", "connect", "aconnect", "Session", "AsyncSession", "Task"]
