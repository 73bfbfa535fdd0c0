"""The old home of ``RemoteFleet`` (``GrpcFleet``, which never imported grpc): kept for one
release; importing it, or ``GrpcFleet``, warns with a ``DeprecationWarning``."""

from __future__ import annotations

import warnings
from typing import Any

from fedgrid.server.remote_fleet import PollResult, RemoteFleet  # noqa: F401 - the old names' new home

__all__ = ["RemoteFleet", "PollResult"]

warnings.warn(
    "fedgrid.server.grpc_fleet is deprecated and goes in the next release: use fedgrid.server.remote_fleet",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    if name == "GrpcFleet":
        warnings.warn(
            "GrpcFleet is deprecated and goes in the next release: use fedgrid.server.remote_fleet.RemoteFleet",
            DeprecationWarning,
            stacklevel=2,
        )
        return RemoteFleet
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
