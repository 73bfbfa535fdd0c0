"""Coordinator: round engine, remote fleet, gRPC service (the fleet contract: ``fedgrid.fleet``)."""

from fedgrid.server.engine import RoundEngine

__all__ = ["RoundEngine"]
