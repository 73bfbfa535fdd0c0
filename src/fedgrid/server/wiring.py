"""A coordinator's parts, built from a ``Config`` before it serves: the initial global model, the
fleet, the run directory, the event log, the monitor and the round engine (``wire``).
``fedgrid.server.serve`` starts the servers around them; a region (``fedgrid.region``) builds its
fleet here too.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Sequence

from fedgrid.aggregation import Strategy
from fedgrid.clock import MONOTONIC, Clock
from fedgrid.config import Config
from fedgrid.constants import FINISH_GRACE_S, ROUND_RETRIES
from fedgrid.determinism import environment
from fedgrid.errors import ConfigError
from fedgrid.events import Event, EventLog
from fedgrid.plugins import is_factory_spec, model_state
from fedgrid.runlog import RunWriter, load_model
from fedgrid.server.engine import RoundEngine
from fedgrid.server.monitor import CoordinatorMonitor
from fedgrid.server.parts import EvaluateFn, RunIO, RunParts, Schedule, build_parts
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.state import StateStore, read_state_key
from fedgrid.server.strategies import build_capability_filter
from fedgrid.types import ModelState, RoundMetrics

__all__ = ["Wired", "wire", "coordinator_model", "build_fleet", "open_store", "write_address"]

log = logging.getLogger(__name__)


def coordinator_model(config: Config) -> ModelState | None:
    """The initial global model that ``config`` names without dataset code: the
    ``initial_model`` safetensors file, or the seeded ``MODULE:FACTORY`` of ``model``;
    ``None`` for a built-in model (a name, ``gpt:...`` or ``hf:PATH``).

    Raises:
        ConfigError: a missing or unreadable file, or a factory that cannot build a model.
    """
    if config.initial_model:
        path = Path(config.initial_model)
        if not path.is_file():
            raise ConfigError("initial_model", f"file {config.initial_model!r} does not exist")
        try:
            return load_model(path)
        except Exception as exc:  # safetensors raises its own error types
            raise ConfigError(
                "initial_model", f"{config.initial_model!r} is not a readable safetensors file: {exc}"
            ) from None
    if is_factory_spec(config.model):
        return model_state(config.model, seed=config.seed)
    return None


def build_fleet(config: Config, events: EventLog, parts: RunParts, clock: Clock = MONOTONIC) -> RemoteFleet:
    """The ``RemoteFleet`` of a coordinator (or a region's) with ``config``'s links, limits and spill
    directory, checking and sending what ``parts`` (``build_parts(config, ...)``) say, on ``clock``."""
    return RemoteFleet(
        events=events,
        heartbeat_interval=timedelta(seconds=config.heartbeat_interval_s),
        chunk_size=config.chunk_size,
        spill_dir=Path(config.state_dir) / "updates" if config.state_dir else None,
        codec_policy=parts.codec_policy,
        downlink_codec=parts.downlink_codec,
        bounds=parts.bounds,
        requirements=build_capability_filter(config),
        clock=clock,
    )


def open_store(config: Config, *, keep: int = 3) -> StateStore | None:
    """The ``StateStore`` of ``config.state_dir`` (``None`` without one), authenticated with the
    ``state_key`` file's key; with ``fresh`` the directory's old files are set aside first.

    Raises:
        ConfigError: an unreadable or short ``state_key`` file (named).
    """
    if not config.state_dir:
        return None
    try:
        key = read_state_key(config.state_key) if config.state_key else None
    except ValueError as exc:
        raise ConfigError("state_key", str(exc)) from None
    store = StateStore(config.state_dir, keep=keep, key=key)
    if config.fresh:
        aside = store.set_aside()
        if aside is not None:
            log.warning(
                "--fresh: a new run in %s; the previous run's files are in %s", config.state_dir, aside
            )
    return store


def write_address(path: Path, address: str) -> None:
    """Writes ``address`` to ``path`` atomically: a script waiting for the file never reads half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(address + "\n")
    os.replace(tmp, path)


@dataclass(frozen=True)
class Wired:
    """A coordinator's parts before it serves: the run's directory, its events, the fleet,
    the round engine and (with ``config.http``) the monitor."""

    writer: RunWriter
    events: EventLog
    fleet: RemoteFleet
    engine: RoundEngine
    monitor: CoordinatorMonitor | None


def wire(
    config: Config,
    threads: int,
    initial: ModelState,
    evaluate_fn: EvaluateFn | None,
    on_event: Callable[[Event], None] | None,
    strategy: Strategy | None = None,
    clock: Clock = MONOTONIC,
) -> Wired:
    """Builds the strategy (unless given), the run directory, the event log, the fleet (on ``clock``),
    the monitor and the engine.

    Raises:
        ConfigError: a strategy option out of range, or a ``min_quorum`` above ``min_clients``
            (a round may start with ``min_clients`` clients; nothing is created then).
    """
    _check_quorum_fits(config)
    # A bad strategy option, quota or noise key file fails before anything is created. The noise
    # key is fresh and secret; a resume restores the run's.
    parts = build_parts(config, num_clients=config.min_clients, where="coordinator", given=strategy)
    store = open_store(config)
    parts.strategy.initialize(initial_state=initial)
    writer = RunWriter(
        config.out,
        {**config.to_dict(), "threads": threads},
        environment=environment(threads_requested=config.threads),
    )
    events = EventLog(writer.dir / "events.jsonl")
    fleet = build_fleet(config, events, parts, clock)
    engine: RoundEngine  # built below; the status server serves (reads its history) only once it is
    monitor = _monitor(config, fleet, events, history=lambda: engine.history)
    if on_event is not None:  # after the monitor: a caller reading the status sees the event counted
        events.subscribe(on_event)
    on_round = _round_printer(config.rounds)
    engine = RoundEngine(
        strategy=parts.strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=config.rounds,
            min_clients=config.min_clients,
            round_timeout=timedelta(seconds=config.round_timeout_s),
            join_timeout=timedelta(seconds=config.join_timeout_s),
            eval_every=config.eval_every,
            finish_timeout=timedelta(seconds=FINISH_GRACE_S),
            round_retries=ROUND_RETRIES,
        ),
        rules=parts.rules,
        io=RunIO(
            evaluate_fn=evaluate_fn,
            writer=writer,
            on_round=on_round if monitor is None else _both(on_round, monitor.on_round),
            store=store,
            events=events,
            eval_in_background=True,  # the clients train the next round meanwhile (server/evaluation.py)
        ),
    )
    return Wired(writer, events, fleet, engine, monitor)


def _check_quorum_fits(config: Config) -> None:
    """A round may start with ``min_clients`` clients: a larger ``min_quorum`` is never reached.

    Raises:
        ConfigError: naming ``min_quorum`` and both numbers.
    """
    if config.min_quorum > config.min_clients:
        raise ConfigError(
            "min_quorum",
            f"a quorum of {config.min_quorum} is larger than min_clients={config.min_clients}, the "
            "clients a round may start with: raise min_clients to at least min_quorum",
        )


def _monitor(
    config: Config, fleet: RemoteFleet, events: EventLog, *, history: Callable[[], Sequence[RoundMetrics]]
) -> CoordinatorMonitor | None:
    """The monitor ``config.http`` asks for, subscribed to ``events``; ``None`` without ``http``."""
    if not config.http:
        return None
    monitor = CoordinatorMonitor(fleet, rounds=config.rounds, history=history)
    events.subscribe(monitor.on_event)
    return monitor


def _both(
    first: Callable[[RoundMetrics], None], second: Callable[[RoundMetrics], None]
) -> Callable[[RoundMetrics], None]:
    """One round callback that calls ``first``, then ``second``."""

    def call(metrics: RoundMetrics) -> None:
        first(metrics)
        second(metrics)

    return call


def _round_printer(rounds: int) -> Callable[[RoundMetrics], None]:
    """The engine's ``on_round`` of a coordinator: a line on stdout per round of ``rounds``."""

    def on_round(m: RoundMetrics) -> None:
        acc = "" if m.accuracy is None else f" accuracy {m.accuracy:.4f}"
        print(
            f"round {m.round}/{rounds} loss {m.loss if m.loss is None else round(m.loss, 4)}{acc} {m.clients_ok} clients ok, {m.clients_failed} failed ({m.wall_s:.2f}s)",
            flush=True,
        )

    return on_round
