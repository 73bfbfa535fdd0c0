"""``run_simulation``: a whole federated run in one process, through the same round engine,
strategy and serialization as a deployed coordinator."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Callable

from fedgrid.config import Config
from fedgrid.runlog import RunWriter
from fedgrid.server.engine import RoundEngine
from fedgrid.server.codec_policy import build_codec_policy
from fedgrid.server.strategies import build_strategy
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.simulation.tasks import resolve
from fedgrid.types import ModelState, RoundMetrics

__all__ = ["run_simulation"]

log = logging.getLogger(__name__)


def run_simulation(config: Config, *, on_round: Callable[[RoundMetrics], None] | None = None) -> tuple[ModelState, list[RoundMetrics]]:
    """Runs ``config.rounds`` rounds over ``config.clients`` in-process clients.

    Client ``i`` is the same client that ``fedgrid client --partition i/N --seed S`` runs.
    Returns the final global model and the per-round metrics.
    """
    strategy = build_strategy(config, num_clients=config.clients)  # a bad option fails before any work
    resolved = resolve(task=config.task, model=config.model, app=config.app, seed=config.seed)
    strategy.initialize(initial_state=resolved.initial_state)
    options = {} if config.app else {"partitioner": config.partition}
    clients = [resolved.client_factory(i, config.clients, config.seed, **options) for i in range(config.clients)]
    writer = RunWriter(config.out, config.to_dict()) if config.out else None
    engine = RoundEngine(
        strategy=strategy,
        fleet=InProcessFleet(
            clients, chunk_size=config.chunk_size, codec_policy=build_codec_policy(config), downlink_codec=config.downlink_codec
        ),
        rounds=config.rounds,
        min_clients=1,
        round_timeout=timedelta(seconds=config.round_timeout_s),
        join_timeout=timedelta(seconds=config.join_timeout_s),
        evaluate_fn=resolved.evaluate,
        writer=writer,
        on_round=on_round,
    )
    final = engine.run()
    return final, engine.history
