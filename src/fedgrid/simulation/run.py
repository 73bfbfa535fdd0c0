"""``run_simulation``: a whole federated run in one process, through the same round engine,
strategy and serialization as a deployed coordinator."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable, Sequence

from fedgrid.allocator import keep_large_buffers
from fedgrid.client.api import Client
from fedgrid.config import Config
from fedgrid.determinism import environment, intra_op_threads
from fedgrid.errors import ConfigError
from fedgrid.fleet.base import QUORUM_NEEDS_REPLAY, Fleet
from fedgrid.runlog import RunWriter
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import RunIO, RunParts, Schedule, build_parts
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.simulation.heterogeneity import ClientProfiles, check_heterogeneity
from fedgrid.simulation.replay import ReplayFleet, read_merges
from fedgrid.simulation.tasks import (
    Resolved,
    check_config,
    client_options,
    resolve,
    site_data_model,
    sites_bring_the_data,
)
from fedgrid.types import ModelState, RoundMetrics

__all__ = ["run_simulation", "clients_per_second"]

log = logging.getLogger(__name__)


def clients_per_second(metrics: RoundMetrics) -> float:
    """Client updates a round delivered per second of its wall time."""
    return metrics.clients_ok / metrics.wall_s if metrics.wall_s > 0 else 0.0


def run_simulation(
    config: Config,
    *,
    clients: Sequence[Client] | None = None,
    on_round: Callable[[RoundMetrics], None] | None = None,
    on_start: Callable[[str, str], None] | None = None,
    stop: threading.Event | None = None,
) -> tuple[ModelState | None, list[RoundMetrics]]:
    """Runs ``config.rounds`` rounds over ``config.clients`` in-process clients.

    Client ``i`` is the same client that ``fedgrid client --partition i/N --seed S`` runs
    with the same data and training options (``fedgrid.simulation.tasks.CLIENT_KEYS``).
    Availability, speed and region follow ``ClientProfiles`` (the heterogeneity keys).
    Returns the final global model and the per-round metrics.

    ``clients`` replaces the clients ``config`` builds (``config.clients`` becomes their number):
    a run whose sites bring their own trainer and data (``fedgrid.integrations.simulated``). Its
    model is then the coordinator's of such a run: ``--model hf:PATH`` (with ``--peft``) built
    alone, without a server-side evaluation, as ``fedgrid coordinator`` builds it; any other
    model as the dataset and model keys say.

    ``on_start(engine, why)`` hears the engine in use (``auto`` resolves to ``batched`` or
    ``sequential``) before the first round. Setting ``stop`` ends the run after the round in
    progress: the final model is then ``None``, and the run directory holds the model of the
    last round done.

    The run uses ``config.threads`` intra-op threads (restored afterwards). On the
    sequential engine its model is bit-identical to a deployment whose coordinator and
    client processes use the same thread count and torch build; on the batched engine it
    is equal within ``fedgrid.determinism.BATCHED_ATOL`` (see that module). The run
    directory's ``config.toml`` records the thread count and the engine actually used, and
    its ``[environment]`` table the torch version, so ``--config RUN/config.toml`` reruns
    it bit for bit.
    """
    if clients is not None:
        config = replace(config, clients=len(clients))
    if clients is None or not sites_bring_the_data(config.dataset, config.model):
        check_config(config)  # the data, model and heterogeneity keys, before any work
    else:  # the sites bring the data: the model is checked as it is built (site_data_model)
        check_heterogeneity(config)
    with intra_op_threads(config.threads) as threads:
        return _run(config, threads, clients, on_round, on_start, stop)


def _ranks() -> tuple[int, int]:
    """(rank, world size) of the default ``torch.distributed`` group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_hierarchy(config: Config) -> None:
    """A hierarchy's global strategy takes whole models, and its regions cannot overlap their sync.

    Raises:
        ConfigError: naming the strategy or the overlap key.
    """
    from fedgrid.errors import ConfigError
    from fedgrid.region.region import PARTIAL_ALGORITHMS

    if config.strategy in PARTIAL_ALGORITHMS:
        raise ConfigError(
            "strategy",
            f"{config.strategy} clients send part of the model or extra tensors; the regions of a hierarchy "
            "send their whole model (use fedavg, the fedopt family or diloco as the global strategy)",
        )
    for key in ("sync_delay_steps", "merge_alpha", "inner_time_s"):
        if getattr(config, key):
            raise ConfigError(
                key,
                "the regions of a hierarchy send their model after their regional rounds and take the "
                "global one whole: they cannot overlap their sync (fedgrid region --strategy ... --"
                f"{key.replace('_', '-')} overlaps the workers inside a region)",
            )


def _regions(config: Config, clients: list, profiles: ClientProfiles) -> list:
    """The regions of a hierarchical simulation, each a ``RegionClient`` over its own clients, as ``fedgrid region`` runs it.

    A region's clients are those ``profiles`` labels with its name; it trains them with
    ``region_strategy`` (its defaults, and the run's ``local_epochs``, ``lr``, ``seed``,
    ``fraction_fit`` and ``lora_aggregation``) on the ``lan_codec`` uplink, ``regional_rounds`` rounds per global task.

    Raises:
        ConfigError: ``hierarchy`` without ``regions``.
    """

    from fedgrid.config import STRATEGY_KEYS
    from fedgrid.errors import ConfigError
    from fedgrid.region.region import RegionClient

    _check_hierarchy(config)
    labels = sorted({profiles.region(i) for i in range(len(clients))} - {""})
    if not labels:
        raise ConfigError(
            "hierarchy", "needs regions (e.g. regions = 'eu:0.5,us:0.5'): the tiers to aggregate in"
        )
    # The regional strategy's own defaults; but the adapters' merge is the run's, as a deployed
    # region's --lora-aggregation must be: its clients are the run's, of the run's ranks.
    defaults: dict[str, Any] = {k: None for k in STRATEGY_KEYS if k != "lora_aggregation"}
    regional = replace(config, strategy=config.region_strategy, **defaults)
    if config.secagg:  # the regions aggregate securely; the ring is their clients' uplink codec
        regional = replace(regional, codec=config.lan_codec, hierarchy=False, region_codecs="")
    out = []
    for label in labels:
        mine = [c for i, c in enumerate(clients) if profiles.region(i) == label]
        # As a deployed region's: its clients' uplink is the LAN codec.
        parts = build_parts(regional, num_clients=len(mine), where="region", uplink=config.codecs.lan)
        fleet = InProcessFleet(
            mine,
            chunk_size=config.chunk_size,
            codec_policy=parts.codec_policy,
            engine=config.engine,
            batch_clients=config.batch_clients,
            bounds=parts.bounds,
        )
        engine = RoundEngine(
            strategy=parts.strategy,
            fleet=fleet,
            schedule=Schedule(
                rounds=0,
                min_clients=1,
                round_timeout=timedelta(seconds=config.round_timeout_s),
                join_timeout=timedelta(seconds=config.join_timeout_s),
            ),
            rules=parts.rules,
        )
        out.append(RegionClient(engine, name=label, regional_rounds=config.regional_rounds))
    return out


def _fleet(config: Config, parts: RunParts, clients: list, profiles: ClientProfiles) -> InProcessFleet:
    """The simulation's fleet: its clients, or with ``hierarchy`` its regions over them (whose
    own fleets train their clients); building it checks that its engine can train them."""
    members: list = list(clients)
    if config.hierarchy:
        members = _regions(config, clients, profiles)
    fleet = InProcessFleet(
        members,
        chunk_size=config.chunk_size,
        codec_policy=parts.codec_policy,
        downlink_codec=parts.downlink_codec,
        # A region's engine is its own; a replay trains one recorded result at a time.
        engine="sequential" if config.hierarchy or config.replay else config.engine,
        batch_clients=config.batch_clients,
        profiles=None if config.hierarchy else profiles,
        bounds=parts.bounds,
    )  # checks the engine can train these clients: fails before the run directory exists
    if fleet.device is not None and fleet.device.type == "cpu":
        keep_large_buffers()  # the batched engine frees and reallocates the same large buffers at every step
    return fleet


def _check_replay(config: Config) -> None:
    """Quorum rounds simulate only as a replay, on the sequential engine, unsharded.

    Raises:
        ConfigError: ``min_quorum`` without ``replay`` or the reverse, or ``replay`` with the
            batched engine or a hierarchy.
    """
    if config.min_quorum and not config.replay:
        raise ConfigError("min_quorum", QUORUM_NEEDS_REPLAY)
    if not config.replay:
        return
    if not config.min_quorum:
        raise ConfigError(
            "replay",
            "needs the deployment's min_quorum and staleness_exponent (--config RUN_DIR/config.toml)",
        )
    if config.engine == "batched" or config.hierarchy:
        raise ConfigError("replay", "runs on the sequential engine without a hierarchy (engine sequential)")


def _reporter(on_round: Callable[[RoundMetrics], None] | None) -> Callable[[RoundMetrics], None]:
    """What rank 0 runs after each round: a log line, then ``on_round``."""

    def report(metrics: RoundMetrics) -> None:
        log.info(
            "round %d: %d clients in %.2fs (%.1f clients/s)",
            metrics.round,
            metrics.clients_ok,
            metrics.wall_s,
            clients_per_second(metrics),
        )
        if on_round is not None:
            on_round(metrics)

    return report


def _writer(config: Config, threads: int, engine: str) -> RunWriter:
    """The run directory's writer: the configuration as run (threads, engine) and the environment."""
    recorded = {**config.to_dict(), "threads": threads, "engine": engine}
    return RunWriter(
        config.out,
        recorded,
        environment=environment(engine_requested=config.engine, threads_requested=config.threads),
    )


def _clients(config: Config, factory: Callable[..., Client]) -> list[Client]:
    """Clients ``0..config.clients - 1`` from ``factory``: the built-in one gets the run's data and
    training options (``client_options``), a custom ``app`` none."""
    options = {} if config.app else {"options": client_options(config)}
    clients = [factory(i, config.clients, config.seed, **options) for i in range(config.clients)]
    if config.secagg:  # each with its identity key, all trusting each other's (fedgrid.client.secagg)
        from fedgrid.client.secagg import with_secagg

        # Under DP each adds its share of the noise, keyed from the seed and its name (reproducible).
        noise_seed = config.seed if config.dp_noise_multiplier else None
        return list(with_secagg(clients, noise_seed=noise_seed))
    return clients


def _run_fleet(config: Config, fleet: InProcessFleet, rank: int, world: int) -> Fleet:
    """The fleet the run's engine drives: ``fleet``; under torchrun (``world`` > 1) this rank's
    share of it; with ``replay``, the replay of a deployment's quorum rounds over it."""
    run_fleet: Fleet = fleet
    if world > 1:  # torchrun: this rank trains its share of the clients (simulation/sharded.py)
        from fedgrid.simulation.sharded import ShardedFleet

        run_fleet = ShardedFleet(fleet, rank=rank, world=world)
    if config.replay:  # the determinism contract of quorum rounds (simulation/replay.py)
        run_fleet = ReplayFleet(
            fleet, read_merges(config.replay), staleness_exponent=config.staleness_exponent
        )
    return run_fleet


def _resolve(config: Config, *, sites: bool) -> Resolved:
    """The run's model, evaluation and client factory; with clients of the sites' own
    (``sites``), a ``--model hf:PATH`` built alone, as the coordinator of such a run builds it."""
    if sites and sites_bring_the_data(config.dataset, config.model):
        return site_data_model(
            model=config.model, seed=config.seed, peft=config.peft, lora_aggregation=config.lora_aggregation
        )
    return resolve(
        dataset=config.dataset,
        model=config.model,
        app=config.app,
        seed=config.seed,
        data_dir=config.data_dir,
        precision=config.precision,
        peft=config.peft,
        lora_aggregation=config.lora_aggregation,
        eval_batches=config.eval_batches,
        text_column=config.text_column,
    )


def _run(
    config: Config,
    threads: int,
    given: Sequence[Client] | None,
    on_round: Callable[[RoundMetrics], None] | None,
    on_start: Callable[[str, str], None] | None,
    stop: threading.Event | None,
) -> tuple[ModelState | None, list[RoundMetrics]]:
    # A bad option, quota or noise key file fails before any work.
    parts = build_parts(config, num_clients=config.clients, where="simulation")
    _check_replay(config)
    resolved = _resolve(config, sites=given is not None)
    parts.strategy.initialize(initial_state=resolved.initial_state)
    profiles = ClientProfiles.from_config(config)
    clients = list(given) if given is not None else _clients(config, resolved.client_factory)
    fleet = _fleet(
        config, parts, clients, profiles
    )  # a fleet that cannot train fails before the run directory exists
    rank, world = _ranks()
    run_fleet = _run_fleet(config, fleet, rank, world)
    writer = _writer(config, threads, fleet.engine) if config.out and rank == 0 else None
    engine = RoundEngine(
        strategy=parts.strategy,
        fleet=run_fleet,
        schedule=Schedule(
            rounds=config.rounds,
            min_clients=1,
            round_timeout=timedelta(seconds=config.round_timeout_s),
            join_timeout=timedelta(seconds=config.join_timeout_s),
            eval_every=config.eval_every,
        ),
        rules=parts.rules,
        io=RunIO(
            evaluate_fn=resolved.evaluate,
            writer=writer,
            on_round=_reporter(on_round) if rank == 0 else None,
            stop=stop,
        ),
    )
    log.info("engine: %s (%s)", fleet.engine, fleet.engine_reason)
    if on_start is not None:
        on_start(fleet.engine, fleet.engine_reason)
    try:
        final = engine.run()
    finally:
        if writer is not None:
            writer.close()  # the trackers (fedgrid.trackers)
    return final, engine.history
