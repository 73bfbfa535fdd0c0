"""Federated simulation: in-process fleets, datasets, partitioners and built-in tasks."""

__all__: list[str] = []
