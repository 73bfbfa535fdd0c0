"""A run's round parts, built once from its ``Config`` (``build_parts``): the same builder for a
coordinator (``server/wiring.py``), a region (``fedgrid.region``) and a simulation
(``fedgrid.simulation.run``), so the three cannot read a key differently.

The parts: the strategy, what the fleet checks and sends (update bounds, the uplink codec
policy, the downlink's codec) and what the round engine does with a fit round's results beside
the strategy (``RoundRules``: quorum, influence caps, differential privacy). The round engine
takes them with its ``Schedule`` (how many rounds, when and how long) and its ``RunIO`` (what
it reads and writes around the rounds).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Callable, Literal

from fedgrid.aggregation.base import Strategy
from fedgrid.compression.spec import CodecSpec
from fedgrid.config import Config
from fedgrid.events import EventLog
from fedgrid.fleet.base import Quorum, quorum_of
from fedgrid.fleet.bounds import UpdateBounds, build_bounds
from fedgrid.fleet.codec_policy import CodecPolicy, build_codec_policy
from fedgrid.runlog import RunWriter
from fedgrid.server.evaluation import EvaluateFn
from fedgrid.server.influence import Influence, build_influence
from fedgrid.server.privacy import Privacy, build_privacy
from fedgrid.server.state import StateStore
from fedgrid.server.strategies import build_strategy
from fedgrid.types import RoundMetrics

__all__ = ["RunParts", "RoundRules", "Schedule", "RunIO", "EvaluateFn", "build_parts", "Where"]


#: Who runs the rounds: a coordinator (DP with a fresh secret noise key), a region (no DP and no
#: quorum: the global coordinator applies them) or a simulation (DP keyed from the seed).
Where = Literal["coordinator", "region", "simulation"]


@dataclass(frozen=True)
class RoundRules:
    """What the round engine does with a fit round's results beside the strategy.

    Attributes:
        quorum: semi-asynchronous fit rounds (``fedgrid.fleet.base.Quorum``; docs/failures.rst):
            a round closes at its quorum, late results are merged into later rounds as
            differences from their task's model, weighted ``num_examples * (1 + staleness) **
            -a``, and each merge is recorded as a ``merged`` event. ``None``: every round waits
            for all its clients.
        influence: the caps on each fit round's results once it closed (``server/influence.py``):
            far updates refused, claims capped. Default: ``Influence()``, on.
        privacy: differential privacy of the fit rounds (``server/privacy.py``): clipping and
            noise after the influence caps, the budget checked before each round. ``None``: off.
    """

    quorum: Quorum | None = None
    influence: Influence = field(default_factory=Influence)
    privacy: Privacy | None = None


@dataclass(frozen=True)
class Schedule:
    """How many rounds the engine runs, when a round may start and how long it and the run's end take.

    Attributes:
        rounds: number of rounds to run.
        min_clients: a round starts only when this many clients are live.
        round_timeout: each round closes by this deadline.
        join_timeout: longest wait for ``min_clients`` before a round.
        eval_every: the server-side evaluation runs after rounds that are a multiple of this and
            after the last one; the others have no loss of it (their clients wait for no evaluation).
        finish_timeout: longest wait for the clients to hear that the run finished.
        round_retries: a fit round whose results are all lost fails (``round_failed``) and runs
            again under the same number, at most this many times in a row, then the run stops
            (``server/round_failures.py``). 0: such a round is committed with no results.

    Raises:
        ValueError: ``eval_every`` under 1.
    """

    rounds: int
    min_clients: int
    round_timeout: timedelta
    join_timeout: timedelta
    eval_every: int = 1
    finish_timeout: timedelta = timedelta(seconds=15)
    round_retries: int = 0

    def __post_init__(self) -> None:
        if self.eval_every < 1:
            raise ValueError(f"eval_every must be at least 1, got {self.eval_every}")


@dataclass(frozen=True)
class RunIO:
    """What the round engine reads and writes around its rounds; each is optional.

    Attributes:
        evaluate_fn: server-side evaluation ``state -> (loss, metrics)`` (``Schedule.eval_every``).
        writer: where metrics and the final model go.
        on_round: called with each round's metrics (progress display).
        store: durable state; when given, ``run`` resumes after the last committed round.
        events: where ``resumed``, ``aggregating``, ``round_committed`` and ``finished`` go
            (``fedgrid.events``); default: nowhere.
        stop: once set, ``run`` ends before its next round (the open one finishes and commits;
            ``RoundEngine.stop()`` abandons it instead).
        eval_in_background: ``evaluate_fn`` runs beside the next round on a snapshot, its figures
            landing in its round's row when ready (a coordinator: ``server/evaluation.py``);
            ``False``: before the round commits (a simulation: the same figures, in order).
    """

    evaluate_fn: EvaluateFn | None = None
    writer: RunWriter | None = None
    on_round: Callable[[RoundMetrics], None] | None = None
    store: StateStore | None = None
    events: EventLog | None = None
    stop: threading.Event | None = None
    eval_in_background: bool = False


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
