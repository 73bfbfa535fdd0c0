"""The keys of ``fedgrid region`` and of simulated hierarchies, a group that ``fedgrid.config.Config``
inherits (``fedgrid.config_values.key``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedgrid.config_values import key as _key

__all__ = ["RegionKeys"]


@dataclass(frozen=True)
class RegionKeys:
    """Regions: a tier between the clients and the global coordinator."""

    upstream: str = _key("fedgrid region: HOST:PORT of the global coordinator it joins as one client", "")
    name: str = _key(
        "fedgrid region: its name ([A-Za-z0-9._-], at most 64): its client name upstream and its region label",
        "",
    )
    regional_rounds: int = _key(
        "fedgrid region, and simulate with hierarchy: H, regional rounds per global round (hierarchical local SGD)",
        1,
    )
    hierarchy: bool = _key(
        "simulation: the regions (the regions key) are tiers, as fedgrid region runs them: each aggregates its clients "
        "regional_rounds rounds with region_strategy and the lan_codec uplink, then sends its model up (codec, "
        "region_codecs: the WAN uplink) to the global strategy",
        False,
    )
    region_strategy: str = _key(
        "simulation with hierarchy: the regions' own strategy, with its defaults (the global tier's is strategy)",
        "fedavg",
    )
    lan_codec: str = _key(
        "simulation with hierarchy: the uplink codec from a region's clients to it (a region's codec)", "none"
    )
    upstream_ca: str = _key(
        "fedgrid region, mutual TLS upstream: PEM CA bundle that signs the global coordinator's certificate",
        "",
    )
    upstream_cert: str = _key(
        "fedgrid region, mutual TLS upstream: the region's client certificate (its identity is its name upstream)",
        "",
    )
    upstream_key: str = _key("fedgrid region, mutual TLS upstream: the region's client key", "")
    upstream_server_name: str = _key(
        "fedgrid region: the name the global coordinator's certificate holds, when not the host of upstream",
        "",
    )
