"""``fedgrid region``: the coordinator of a region's clients, and one client of the global coordinator.

A region runs its own fleet, round engine, state directory and strategy for the clients on
its LAN, and joins the global coordinator as a single client (its ``name`` is its client
name and its region label). Each global task is H regional rounds (hierarchical local SGD):

1. the global model the task downloads becomes the regional strategy's model
   (``Strategy.receive_global``; the first task initializes it);
2. H regional rounds run on the region's clients, each committed to the region's own run
   directory and state directory;
3. the regional model goes up, weighted by the examples of the last regional round's
   clients (a weighted mean of weighted means: with H = 1 and lossless links, flat FedAvg).

**Links.** The region's ``codec`` / ``downlink_codec`` are its LAN links; the global
coordinator's ``codec`` / ``region_codecs`` (the task's ``uplink_codec``) is the region's WAN
uplink, with its own error feedback (``client.runtime``'s encoder, per connection). The
region's ``metrics.jsonl`` counts LAN bytes per regional round; ``wan.jsonl`` counts the WAN
bytes of each global task; the global coordinator's ``metrics.jsonl`` has ``bytes_up.NAME``
and ``bytes_down.NAME`` per region.

**Strategies.** The regional strategy is the region's own (``strategy`` and its keys); the
global one may differ (FedAvg in regions, a DiLoCo outer step globally). A region sends
its whole model, so a global strategy whose clients send part of it or extra tensors
(``scaffold``, ``streaming-diloco``, ``bcd``) is refused by name. So is a global task that
asks its worker to overlap its sync (``sync_delay_steps``, ``merge_alpha``, ``inner_time_s``
of ``fedgrid.aggregation.diloco.Overlap``): a region ends its regional rounds, sends, and takes
the global model whole. Overlapped workers *in* a region are the regional strategy's own
(``fedgrid region --strategy streaming-diloco --sync-delay-steps N``): the region relays
their tasks as any other.

**Goodput.** A region counts as one learner: its fit result carries the sums of its workers'
time splits over its H regional rounds (``compute_s``, ``comm_s``, ``wait_s``, ``transfer_s``;
``wall_s`` the sum of their ``worker_wall_s``), so the global ``utilization.NAME`` is theirs.

**Failures.** A region that dies mid-round is that global round's failure (heard at the
deadline or from the heartbeat); nothing of it is counted. Restarted with the same
``state_dir`` it resumes its committed regional state and rejoins under its name (replacing
the old session); the next global task's model replaces whatever it had. A region that loses
its upstream keeps serving its own clients (they stay joined and idle) and retries its calls
with the same session for as long as it runs: a global coordinator restarted from its state
directory knows that session and its open task (an update trained meanwhile is uploaded when
it answers), one that does not refuses it and the region joins again; a join refused or not
answered within ``UPSTREAM_RETRY_MAX_S`` is tried again with backoff; a refusal that joining
again cannot change (another base or rank, a certificate refused, the name taken) ends the
region with that reason (``fedgrid.region.upstream``).
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping

from fedgrid.aggregation import Strategy
from fedgrid.client.api import Client, FitOutput
from fedgrid.client.runtime import check_target
from fedgrid.config import Config
from fedgrid.constants import FINISH_GRACE_S, ROUND_RETRIES
from fedgrid.determinism import environment, intra_op_threads
from fedgrid.errors import ConfigError
from fedgrid.events import EventLog
from fedgrid.interrupts import GracefulStop, say
from fedgrid.proto.tls import TLSFiles
from fedgrid.region.upstream import UPSTREAM_RETRY_MAX_S, serve_upstream, wan_writer
from fedgrid.runlog import RunWriter
from fedgrid.server.engine import ROUND_FAILED, RoundEngine
from fedgrid.server.parts import RunIO, Schedule, build_parts
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator, build_fleet, rank_policy, write_address
from fedgrid.server.wiring import open_store
from fedgrid.telemetry import SUMMED_KEYS, WORKER_WALL_S, utilization_of
from fedgrid.textsafe import escape
from fedgrid.types import FitIns, MessageIns, ModelState, RoundMetrics

__all__ = ["RegionClient", "run_region", "UPSTREAM_RETRY_MAX_S", "PARTIAL_ALGORITHMS", "OVERLAP_KEYS"]

log = logging.getLogger(__name__)

#: What a region's name may be: it names files, metrics and the region upstream.
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: Global strategies whose clients send something other than the whole model.
PARTIAL_ALGORITHMS = ("scaffold", "streaming-diloco", "bcd")
#: Global task keys that ask a worker to overlap its sync (``Overlap.task_config``): a region cannot.
OVERLAP_KEYS = ("sync_delay_steps", "merge_alpha", "inner_time_s")


@dataclass
class _Sums:
    """What a global task's regional rounds add up to: LAN bytes and the workers' seconds."""

    lan_up: int = 0
    lan_down: int = 0
    workers: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys((*SUMMED_KEYS, WORKER_WALL_S), 0.0)
    )

    def add(self, m: RoundMetrics) -> None:
        self.lan_up, self.lan_down = self.lan_up + m.bytes_up, self.lan_down + m.bytes_down
        for key in self.workers:
            self.workers[key] += float(m.extra.get(key, 0.0))


class RegionClient(Client):
    """The region as one client of the global coordinator: each fit is ``regional_rounds`` rounds of ``engine``.

    Args:
        engine: the region's round engine (its fleet, strategy, writer and store).
        name: the region's name upstream (its client name and region label).
        regional_rounds: H, regional rounds per global task.
        initialized: the strategy already holds a model (resumed from the state directory).
    """

    base_hash: str = ""  # a --peft run's frozen base hash and the region's LoRA rank, shown upstream at Join
    lora_rank: int = 0

    def __init__(
        self, engine: RoundEngine, *, name: str, regional_rounds: int, initialized: bool = False
    ) -> None:
        if regional_rounds < 1:
            raise ValueError(f"regional_rounds must be at least 1, got {regional_rounds}")
        self.engine = engine
        self.name, self.region = name, name
        self.regional_rounds = regional_rounds
        self._initialized = initialized
        #: Examples reported at join (an update may claim no more upstream).
        self.joined_examples = 0

    @property
    def num_examples(self) -> int:
        """The examples of the region's clients now joined (what it reports when it joins upstream)."""
        live = self.engine.fleet.wait_for_clients(min_clients=0, timeout=timedelta(0))
        self.joined_examples = sum(info.num_examples for info in live)
        return self.joined_examples

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        """Runs H regional rounds from the global ``state``; returns the regional model.

        Raises:
            ValueError: a global strategy whose clients send part of the model, or a global task
                that asks for an overlapped sync (named).
            RuntimeError: a regional round that no client completed, or whose aggregate
                failed (the global round hears it as this region's failure).
        """
        _check_global_task(ins.config)
        self._rewind((ins.round - 1) * self.regional_rounds)
        self._take_global(state)
        last, sums = self._regional_rounds(ins.round)
        examples = self._claimed_examples(int(last.extra.get("examples", 0)))
        out = OrderedDict((k, v.detach().clone()) for k, v in self.engine.strategy.global_state.items())
        return FitOutput(state=out, num_examples=max(examples, 1), metrics=self._reported(last, sums))

    def exchange(self, ins: MessageIns) -> Mapping[str, bytes]:
        """Refuses a global strategy's message phases (``ValueError``): a region sends its model whole."""
        raise ValueError(
            f"the global coordinator asks this region for message phase {escape(ins.phase)}; a region sends "
            "its regional model whole: secure aggregation runs inside regions (fedgrid region --secagg)"
        )

    def _rewind(self, boundary: int) -> None:
        """Goes back to the state after regional round ``boundary`` (the end of the previous
        global task) when rounds past it are committed: the region restarted in the middle of
        a global task, or after finishing one whose result never landed, and runs its rounds
        again from the same state, under the same numbers (none is committed twice or skipped).

        The strategy state comes from that round's checkpoint (the region keeps
        ``regional_rounds + 1`` of them); the history, the journal and ``metrics.jsonl`` are cut
        back to it. Round 0: the next task initializes the strategy afresh."""
        engine = self.engine
        if not engine.history or engine.history[-1].round <= boundary:
            return
        history: list[RoundMetrics] = []
        if boundary == 0:
            self._initialized = False
        elif engine.store is not None:
            ckpt = engine.store.load(boundary)  # kept: the region keeps H + 1 checkpoints
            engine.strategy.load_state_dict(ckpt.strategy)
            history = [RoundMetrics.from_json(m) for m in ckpt.history]
        else:  # no state directory: in memory the rounds stay applied; only their numbers go back
            history = [m for m in engine.history if m.round <= boundary]
        log.info(
            "region %s: regional rounds %d to %d run again from the state after round %d",
            escape(self.name),
            boundary + 1,
            engine.history[-1].round,
            boundary,
        )
        engine.history = history
        if engine.store is not None:
            engine.store.sync_history([m.to_json() for m in history])
        if engine.writer is not None:
            engine.writer.reset_metrics([m.to_json() for m in history])

    def _take_global(self, state: ModelState) -> None:
        """The global model becomes the regional strategy's (the first task initializes it)."""
        strategy = self.engine.strategy
        if self._initialized:
            strategy.receive_global(state=state)
        else:
            strategy.initialize(initial_state=OrderedDict((k, v.clone()) for k, v in state.items()))
            self._initialized = True

    def _regional_rounds(self, global_round: int) -> tuple[RoundMetrics, _Sums]:
        """Runs and commits the H regional rounds of global round ``global_round``; returns the
        last one's metrics and what they all add up to.

        Raises:
            RuntimeError: a regional round that no client completed, or whose aggregate failed.
        """
        metrics = None
        sums = _Sums()
        for h in range(1, self.regional_rounds + 1):
            regional_round = (global_round - 1) * self.regional_rounds + h
            # A regional round whose clients all failed runs again under its number (round_retries).
            metrics = self.engine.play_round(regional_round)
            self.engine.commit(metrics)
            sums.add(metrics)
            if metrics.extra.get(ROUND_FAILED) or metrics.clients_ok == 0:
                raise RuntimeError(
                    f"regional round {regional_round} (global round {global_round}, {h} of {self.regional_rounds}): "
                    f"{metrics.clients_ok} clients completed, {metrics.clients_failed} failed"
                    + ("; its aggregate was not finite" if metrics.extra.get(ROUND_FAILED) else "")
                )
        assert metrics is not None
        return metrics, sums

    def _claimed_examples(self, examples: int) -> int:
        """The examples claimed upstream for the last regional round's ``examples``: at most
        those reported at join."""
        if self.joined_examples and examples > self.joined_examples:
            # The coordinator refuses a claim above the join's; clients that joined the region
            # since then count in its average, not in its weight upstream.
            log.warning(
                "region %s: %d examples this round, more than the %d reported at join: claiming %d",
                escape(self.name),
                examples,
                self.joined_examples,
                self.joined_examples,
            )
            return self.joined_examples
        return examples

    def _reported(self, last: RoundMetrics, sums: _Sums) -> dict[str, float]:
        """The fit result's metrics upstream: the region's LAN bytes and clients, the last
        regional round's loss, and its workers' time split (module docstring)."""
        reported = {
            "regional_rounds": float(self.regional_rounds),
            "lan_bytes_up": float(sums.lan_up),
            "lan_bytes_down": float(sums.lan_down),
            "region_clients": float(last.clients_ok),
        }
        if last.loss is not None:
            reported["loss"] = float(last.loss)
        workers = sums.workers
        if workers[WORKER_WALL_S] > 0:  # the split upstream is the workers'
            reported.update({key: workers[key] for key in SUMMED_KEYS})
            reported["wall_s"] = workers[WORKER_WALL_S]
            reported["utilization"] = utilization_of(workers["compute_s"], workers[WORKER_WALL_S])
        return reported


def _check_global_task(config: Mapping[str, Any]) -> None:
    """A global task a region can train: its whole model, without an overlapped sync.

    Raises:
        ValueError: naming the global strategy's algorithm or the overlap keys set.
    """
    algorithm = str(config.get("algorithm", "fedavg"))
    if algorithm in PARTIAL_ALGORITHMS:
        raise ValueError(
            f"the global strategy asks for {algorithm!r}, whose clients send part of the model or extra tensors; "
            "a region sends its whole regional model (use fedavg, the fedopt family or diloco globally)"
        )
    overlap = [k for k in OVERLAP_KEYS if float(config.get(k, 0) or 0) > 0]
    if overlap:
        raise ValueError(
            f"the global task asks this region to overlap its sync ({', '.join(overlap)}); a region "
            "sends its model after its regional rounds and takes the global one whole: unset them on "
            "the global strategy (set them on the region's own strategy for its workers)"
        )


def run_region(
    config: Config,
    *,
    ready: threading.Event | None = None,
    stop: threading.Event | None = None,
    base_hash: str = "",
) -> int:
    """Serves the region's clients and the global coordinator's tasks until the global run ends.

    Uses ``config``'s coordinator keys for the region (``listen``, ``min_clients``, the
    strategy and its keys, ``codec``, ``state_dir``, TLS ``ca``/``cert``/``key``) and its
    region keys (``upstream``, ``name``, ``regional_rounds``, ``upstream_ca``/``_cert``/
    ``_key``/``_server_name``). Returns the global tasks trained; SIGTERM or Ctrl-C (or
    ``stop``) leaves upstream and stops. ``base_hash``: a ``--peft`` run's frozen base
    (``fedgrid.cli.region.serve`` hashes ``--model hf:PATH``), shown upstream and required of its clients.

    Raises:
        ConfigError: no ``upstream`` or ``name``, or a bad one (named); ``min_quorum`` (a
            region's regional rounds are synchronous; upstream it is one learner); peft without base_hash.
    """
    if not config.upstream:
        raise ConfigError("upstream", "a region needs the global coordinator's HOST:PORT (--upstream)")
    try:
        check_target(config.upstream, what="upstream")
    except ValueError as exc:
        raise ConfigError("upstream", str(exc)) from None
    if not NAME.fullmatch(config.name):
        raise ConfigError(
            "name",
            f"a region needs a name of 1 to 64 of [A-Za-z0-9._-] (--name), got {escape(config.name)!r}: "
            "its client name upstream, its region label and part of metric names",
        )
    if config.min_quorum:
        raise ConfigError(
            "min_quorum",
            "a region's regional rounds wait for its clients (it sends one result upstream per "
            "task): set min_quorum on the global coordinator, where the region counts as one learner",
        )
    if config.peft and not base_hash:
        raise ConfigError("model", "a region of a --peft run hashes its base: give it --model hf:PATH")
    with intra_op_threads(config.threads) as threads:
        return _serve(config, threads, ready, stop or threading.Event(), base_hash)


def _parts(config: Config, threads: int) -> tuple[Strategy, RunWriter, EventLog, RemoteFleet, RoundEngine]:
    """A region's parts before it serves: its strategy, run directory, event log, fleet (of its own
    clients) and the engine of its regional rounds (``rounds=0``: the global coordinator's tasks
    decide how many)."""
    # A bad strategy option or quota file fails before the run directory exists.
    parts = build_parts(config, num_clients=config.min_clients, where="region")
    strategy = parts.strategy
    writer = RunWriter(
        config.out,
        {**config.to_dict(), "threads": threads},
        environment=environment(threads_requested=config.threads),
    )
    events = EventLog(writer.dir / "events.jsonl")
    fleet = build_fleet(config, events, parts)
    fleet.task_scope = "region"

    def on_round(m: Any) -> None:
        print(
            f"region {config.name}: regional round {m.round} loss {m.loss if m.loss is None else round(m.loss, 4)} "
            f"{m.clients_ok} clients ok, {m.clients_failed} failed, LAN {m.bytes_up / 1e6:.2f} MB up "
            f"{m.bytes_down / 1e6:.2f} MB down ({m.wall_s:.2f}s)",
            flush=True,
        )

    engine = RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=0,
            min_clients=config.min_clients,
            round_timeout=timedelta(seconds=config.round_timeout_s),
            join_timeout=timedelta(seconds=config.join_timeout_s),
            round_retries=ROUND_RETRIES,
        ),
        rules=parts.rules,
        io=RunIO(
            writer=writer,
            on_round=on_round,
            # H + 1 checkpoints: a restart mid-task goes back to the previous task's end (RegionClient._rewind).
            store=open_store(config, keep=max(3, config.regional_rounds + 1)),
            events=events,
        ),
    )
    return strategy, writer, events, fleet, engine


def _serve(
    config: Config, threads: int, ready: threading.Event | None, stop: threading.Event, base: str
) -> int:
    # Incomplete or unreadable upstream TLS files fail here, before any server starts.
    TLSFiles.from_options(config.upstream_ca, config.upstream_cert, config.upstream_key, what="upstream TLS")
    strategy, writer, events, fleet, engine = _parts(config, threads)
    resumed = engine.resume() > 1
    writer.reset_metrics([m.to_json() for m in engine.history])  # the committed rounds, once each
    region = RegionClient(
        engine, name=config.name, regional_rounds=config.regional_rounds, initialized=resumed
    )
    # Its clients show the base it shows upstream; their LoRA ranks are checked as a coordinator checks them.
    region.base_hash = fleet.base_hash = base
    fleet.lora_ranks = rank_policy(config, fleet.downlink.lossless)
    region.lora_rank = fleet.lora_ranks.bound
    coordinator = Coordinator(
        config.listen,
        fleet,
        max_workers=config.max_workers,
        tls=TLSFiles.from_options(config.ca, config.cert, config.key, config.crl),
        insecure=config.insecure,
    ).start()
    write_address(writer.dir / "address", coordinator.address)
    print(
        f"fedgrid region {config.name} listening on {coordinator.address} (upstream {config.upstream}, {config.regional_rounds} "
        f"regional rounds per global round, dir {writer.dir}{', resumed' if resumed else ''})",
        flush=True,
    )
    events.emit("started", run_id=fleet.run_id, address=coordinator.address, threads=threads)
    if ready is not None:
        ready.set()

    def on_term(signal_name: str) -> None:
        say(f"{signal_name}: region {config.name} stopping; a second one exits at once")
        stop.set()
        engine.stop()

    trained, finished = 0, False
    try:
        with GracefulStop(on_term, what="region"):
            trained, finished = serve_upstream(
                config, region, fleet, stop, wan_writer(writer.dir / "wan.jsonl")
            )
    finally:
        if finished:
            fleet.finish(timeout=timedelta(seconds=FINISH_GRACE_S))
            if engine.history:
                writer.write_model(strategy.global_state)
        coordinator.stop(grace=5.0)
        fleet.close()
        writer.close()
        events.emit("finished" if finished else "stopped", rounds=trained)
        events.close()
    print(
        f"region {config.name}: {trained} global rounds trained; {'run finished' if finished else 'stopped'}",
        flush=True,
    )
    return trained
