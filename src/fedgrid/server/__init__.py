"""Coordinator: round engine, fleets, gRPC service."""

from fedgrid.server.engine import RoundEngine
from fedgrid.server.fleet import Fleet, RoundOutcome

__all__ = ["RoundEngine", "Fleet", "RoundOutcome"]
