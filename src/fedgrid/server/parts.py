"""A run's round parts, built once from its ``Config`` (``build_parts``): the same builder for a
coordinator (``server/wiring.py``), a region (``fedgrid.region``) and a simulation
(``fedgrid.simulation.run``), so the three cannot read a key differently.

The parts: the strategy, what the fleet checks and sends (update bounds, the uplink codec
policy, the downlink's codec) and what the round engine does with a fit round's results beside
the strategy (``RoundRules``: quorum, influence caps, differential privacy).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from fedgrid.aggregation.base import Strategy
from fedgrid.compression.spec import CodecSpec
from fedgrid.config import Config
from fedgrid.fleet.base import Quorum, quorum_of
from fedgrid.fleet.bounds import UpdateBounds, build_bounds
from fedgrid.fleet.codec_policy import CodecPolicy, build_codec_policy
from fedgrid.server.influence import Influence, build_influence
from fedgrid.server.privacy import Privacy, build_privacy
from fedgrid.server.strategies import build_strategy

__all__ = ["RunParts", "RoundRules", "build_parts", "Where"]

#: Who runs the rounds: a coordinator (DP with a fresh secret noise key), a region (no DP and no
#: quorum: the global coordinator applies them) or a simulation (DP keyed from the seed).
Where = Literal["coordinator", "region", "simulation"]


@dataclass(frozen=True)
class RoundRules:
    """What the round engine does with a fit round's results beside the strategy.

    Attributes:
        quorum: semi-asynchronous fit rounds (``fedgrid.fleet.base.Quorum``); ``None``: every
            round waits for all its clients.
        influence: the caps on each fit round's results once it closed (``server/influence.py``).
        privacy: differential privacy of the fit rounds (``server/privacy.py``); ``None``: off.
    """

    quorum: Quorum | None = None
    influence: Influence = field(default_factory=Influence)
    privacy: Privacy | None = None


@dataclass(frozen=True)
class RunParts:
    """A run's round parts (``build_parts``).

    Attributes:
        strategy: the strategy, its ``initialize`` not yet called.
        bounds: what a client may report and an update may claim and change.
        codec_policy: the uplink codec of each client.
        downlink_codec: the downlink's codec (each fleet keeps its own ``Downlink`` of it: the
            shadow of a lossy downlink is the fleet's state).
        rules: quorum, influence caps and privacy, for the round engine.
    """

    strategy: Strategy
    bounds: UpdateBounds
    codec_policy: CodecPolicy
    downlink_codec: CodecSpec
    rules: RoundRules


def build_parts(
    config: Config,
    *,
    num_clients: int,
    where: Where,
    given: Strategy | None = None,
    uplink: CodecSpec | None = None,
) -> RunParts:
    """Builds the round parts of ``config``; a bad option fails here, before any work.

    Args:
        config: the run configuration.
        num_clients: the clients a round may have, for the strategy's preconditions (a
            coordinator's ``min_clients``, a simulation's ``clients``).
        where: who runs the rounds (``Where``).
        given: a strategy built by the caller, used as it is (``build_strategy``).
        uplink: one uplink codec for every client (a simulated region's LAN), instead of
            ``config``'s ``codec`` and ``region_codecs`` in their learning form.

    Raises:
        ConfigError: a strategy option out of range or a precondition ``num_clients`` clients
            cannot meet, an unreadable quota file, or an unreadable ``dp_noise_key`` file.
    """
    # A simulated hierarchy runs secagg inside each region (their own parts), not across them.
    top = replace(config, secagg=False) if config.hierarchy and config.secagg else config
    strategy = build_strategy(top, num_clients=num_clients, given=given)
    influence = build_influence(config)
    region = where == "region"
    privacy = None if region else build_privacy(config, simulation=where == "simulation")
    return RunParts(
        strategy=strategy,
        bounds=build_bounds(config),
        codec_policy=build_codec_policy(config) if uplink is None else CodecPolicy(default=uplink),
        downlink_codec=config.codecs.downlink,
        rules=RoundRules(quorum=None if region else quorum_of(config), influence=influence, privacy=privacy),
    )
