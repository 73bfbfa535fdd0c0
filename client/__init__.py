"""Client SDK: implement or build a ``Client`` and ``run`` it against a coordinator."""

from fedgrid.client.api import Client, EvaluateOutput, FitOutput
from fedgrid.client.runtime import ClientHandle, CoordinatorUnreachable, RunSummary, RpcFailed, run, start
from fedgrid.client.torch_client import TorchClient

__all__ = ["Client", "EvaluateOutput", "FitOutput", "TorchClient", "ClientHandle", "RunSummary", "RpcFailed", "CoordinatorUnreachable", "run", "start"]
