"""Regions: a coordinator of its region's clients that is itself a client of the global coordinator (``fedgrid region``)."""

from fedgrid.region.region import RegionClient, run_region

__all__ = ["RegionClient", "run_region"]
