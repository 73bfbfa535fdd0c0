"""``InProcessFleet``: the simulated clients of a run, trained in this process.

Models cross the same serialization as on the wire (``fedgrid.proto.serde``), so a
simulated run moves the same bytes, and produces the same bits, as a deployed one. A raw
(``none``) uplink is lossless, so its update skips the encoding, framing and decoding that
would hand back the same bits (``upload.raw_passes``); its bytes are counted arithmetically
(``serde.stream_wire_bytes``), equal to the frames'.

A round runs in three phases per group of clients: (1) each client downloads the model,
or the part its task names (``FitIns.download``): the frames a real client would receive,
counted in ``bytes_down``; and gets its task; (2) the clients train, through an engine:
``sequential`` calls ``client.fit`` one client at a time, ``batched`` trains many
``TorchClient`` clients of one model at once with stacked parameters
(``fedgrid.simulation.batched``); (3) each client's update is encoded with its
uplink codec (error feedback per client), framed, decoded (but for a raw one, above), and
accepted by the coordinator's own functions (``fedgrid.simulation.upload``; ``fleet/protocol.py``:
the header's ``delta`` flag and ``num_examples``, then each tensor finite and within the norm
bound, then the round's bytes), so a simulated client fails exactly where a deployed one would, with the
same message; names and counts are checked at construction as at Join. A client's error in
any phase is a ``Failure``, never an exception.

A simulated client's fit result carries the time split a deployed one uploads
(``fedgrid.client.timeline``), with its measured training seconds as both ``compute_s`` and
``wall_s`` (a batched group's seconds shared evenly by its clients): nothing is transferred or
awaited in simulation, so ``comm_s``, ``wait_s`` and ``transfer_s`` are 0. With ``profiles``
(as ``fedgrid simulate`` runs it) the seconds are the simulated ones instead: ``compute_s`` the client's ``train_seconds``,
``wall_s`` the round's (``sim_round_s``) and ``wait_s`` the difference, the time a faster
client waits for the slowest. Measured, these metrics differ between two runs that are
otherwise equal bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from datetime import timedelta
from typing import Mapping, Protocol, Sequence, Union

import torch

from fedgrid.aggregation.lora_ranks import RankViews, specs_at_rank
from fedgrid.client.api import Client, FitOutput
from fedgrid.client.timeline import Split, with_split
from fedgrid.client.uplink import UplinkEncoder
from fedgrid.clock import MONOTONIC, Clock
from fedgrid.compression import available_codecs
from fedgrid.compression.spec import CodecSpec
from fedgrid.errors import ConfigError, InterruptedRunError
from fedgrid.fleet import protocol
from fedgrid.fleet.base import QUORUM_NEEDS_REPLAY, Fleet, Quorum, RoundOutcome
from fedgrid.fleet.bounds import UpdateBounds
from fedgrid.fleet.codec_policy import CodecPolicy
from fedgrid.fleet.downlink import Downlink, RoundDownlink
from fedgrid.fleet.protocol import RoundTally
from fedgrid.interrupts import stopping
from fedgrid.proto import serde
from fedgrid.simulation.batched import BatchedTrainer, choose_engine, recurrent_module
from fedgrid.simulation.fleet_rounds import evaluate_clients, exchange_messages
from fedgrid.simulation.upload import upload
from fedgrid.types import (
    ClientInfo,
    EvaluateIns,
    EvaluateRes,
    Failure,
    FitIns,
    FitRes,
    MessageIns,
    MessageRes,
    ModelState,
    TensorSpec,
)

__all__ = ["InProcessFleet", "Profiles", "ENGINES", "simulated_round"]

log = logging.getLogger(__name__)

#: Values of ``engine``.
ENGINES = ("auto", "batched", "sequential")
#: A round's distinct download streams: (a difference?, base version, the tensors sent or None for all,
#: the LoRA rank of a client of its own, else 0).
_Stream = tuple[bool, int, frozenset[str] | None, int]


class Profiles(Protocol):
    """Simulated heterogeneity of the clients (``fedgrid.simulation.heterogeneity.ClientProfiles``).

    ``index`` is the client's position in the fleet's ``clients``.
    """

    def available(self, index: int, server_round: int) -> bool:
        """Whether client ``index`` takes part in round ``server_round``."""

    def region(self, index: int) -> str:
        """Region label of client ``index`` (empty: none)."""

    def train_seconds(self, index: int, num_examples: int) -> float:
        """Simulated seconds client ``index`` trains a round on ``num_examples`` examples."""


class InProcessFleet(Fleet):
    """Runs ``clients`` in process, through the sequential or the batched engine.

    Args:
        clients: the simulated clients; ``name`` must be unique (it is the ordering key).
        chunk_size: chunk size of the simulated wire.
        codec_policy: uplink codec per client (default: none).
        downlink_codec: the downlink's codec; on a lossless one a client downloads only what
            its task names (``FitIns.download``), on a lossy one what it would without it.
        engine: ``sequential`` (``client.fit`` one by one), ``batched`` (all clients
            trained at once in chunks; fails if they cannot be) or ``auto`` (batched where
            the clients can be batched and it pays: see ``batched.choose_engine``; else
            sequential with a one-line notice; sequential at once, logged at INFO, for a
            model with a recurrent module: ``batched.recurrent_module``). The sequential engine's model is
            bit-identical to a deployment's at the same thread count; the batched one's
            equal within ``fedgrid.determinism.BATCHED_ATOL`` (other kernels, other
            accumulation order).
        batch_clients: clients the batched engine trains at once; 0 chooses from memory.
        profiles: simulated availability, region and training time. A client not available
            in a round fails without training; a client without a region gets its profile's;
            ``RoundOutcome.extra["sim_round_s"]`` is the simulated round time (the slowest
            kept client's ``train_seconds`` on its ``num_examples``); with a ``target``, the
            clients that would finish first by simulated time are the ones kept.
        bounds: the coordinator's bounds on weights and update norms; a result over them is a ``Failure``.
        clock: what a client's measured training seconds are read from (``fedgrid.clock``; a
            test passes a ``ManualClock`` its clients advance).

    Raises:
        ConfigError: an unknown ``engine``, a negative ``batch_clients``, or ``batched`` for
            clients or a model that cannot be batched (the message says why).
        InvalidUpdateError: a client whose name, region or ``num_examples`` a coordinator
            would refuse at Join.
    """

    #: Skip the simulated wire for raw (``none``) uplinks (``upload.raw_passes``); tests turn it off
    #: to compare with the wire's path, bit for bit and byte for byte.
    fast_lossless = True

    def __init__(
        self,
        clients: Sequence[Client],
        *,
        chunk_size: int = serde.CHUNK_SIZE,
        codec_policy: CodecPolicy | None = None,
        downlink_codec: CodecSpec = CodecSpec.NONE,
        engine: str = "sequential",
        batch_clients: int = 0,
        profiles: Profiles | None = None,
        bounds: UpdateBounds | None = None,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.bounds = bounds if bounds is not None else UpdateBounds()
        self.clock = clock
        if engine not in ENGINES:
            raise ConfigError("engine", f"unknown engine {engine!r} (known: {', '.join(ENGINES)})")
        if batch_clients < 0:
            raise ConfigError("batch_clients", f"must be at least 0, got {batch_clients}")
        self._clients: dict[str, Client] = {}
        self._index: dict[str, int] = {}
        self._infos: list[ClientInfo] = []
        codecs = tuple(available_codecs())
        for i, client in enumerate(clients):
            cid = f"sim-{i:05d}"
            self._clients[cid] = client
            self._index[cid] = i
            region = client.region or (profiles.region(i) if profiles is not None else "")
            info = ClientInfo(
                client_id=cid,
                name=client.name or cid,
                region=region,
                num_examples=client.num_examples,
                codecs=codecs,
                lora_rank=client.lora_rank,
            )
            protocol.check_joining(info, self.bounds)
            self._infos.append(info)
        self.chunk_size = chunk_size
        self.codec_policy = codec_policy or CodecPolicy()
        self.profiles = profiles
        self._uplinks: dict[
            tuple[str, str], UplinkEncoder
        ] = {}  # per client and codec, as each client process keeps
        self.downlink = Downlink(downlink_codec)
        self._held: dict[str, int] = {}  # downlink version each client holds
        self._trainer: BatchedTrainer | None = None
        #: The engine in use (``batched`` or ``sequential``) and why.
        self.engine, self.engine_reason = "sequential", "requested"
        recurrent = recurrent_module(clients) if engine == "auto" else None
        if recurrent is not None:  # decided before a trial batched step, which would warn
            self.engine_reason = recurrent
            log.info("engine: sequential (%s)", recurrent)
        elif engine != "sequential":
            self._choose(engine, BatchedTrainer(list(clients), batch_clients=batch_clients))

    def index_of(self, client_id: str) -> int:
        """The position of client ``client_id`` in the list the fleet was made with."""
        return self._index[client_id]

    @property
    def device(self) -> torch.device | None:
        """Where the batched engine trains; ``None`` on the sequential engine (each client's own device)."""
        return self._trainer.device if self._trainer is not None else None

    def _choose(self, engine: str, trainer: BatchedTrainer) -> None:
        if trainer.reason is not None:
            if engine == "batched":
                raise ConfigError(
                    "engine",
                    f"the batched engine cannot train these clients: {trainer.reason}; use --engine sequential",
                )
            self.engine_reason = trainer.reason
            log.warning("engine: sequential (%s)", trainer.reason)
            return
        choice, why = (
            choose_engine(device=trainer.device, conv_share=trainer.conv_share)
            if engine == "auto"
            else ("batched", "requested")
        )
        self.engine, self.engine_reason = choice, why
        if choice == "batched":
            self._trainer = trainer
            log.info(
                "engine: batched on %s (%s; up to %d clients at once)",
                trainer.device,
                why,
                trainer.clients_per_call,
            )
        else:
            log.info("engine: sequential (%s)", why)

    def _uplink(self, client_id: str, codec: CodecSpec) -> UplinkEncoder:
        key = (client_id, codec.text)
        if key not in self._uplinks:
            self._uplinks[key] = UplinkEncoder(codec)
        return self._uplinks[key]

    def wait_for_clients(self, *, min_clients: int, timeout: timedelta) -> list[ClientInfo]:
        if len(self._infos) < min_clients:
            raise TimeoutError(
                f"simulation has {len(self._infos)} clients, fewer than min_clients={min_clients}"
            )
        return list(self._infos)

    def _download(
        self,
        downlink: RoundDownlink,
        server_round: int,
        info: ClientInfo,
        cache: dict[_Stream, tuple[ModelState, int]],
        names: frozenset[str] | None = None,
        views: RankViews | None = None,
    ) -> tuple[ModelState, int]:
        """What ``info``'s client holds after downloading (its own copy), and the bytes it downloaded.

        ``names``: on a lossless downlink, the client downloads only these tensors
        (``FitIns.download_names``). Clients that download the same stream (same kind, same
        base version, same tensors) receive the same frames: ``cache`` keeps the first one's
        decoded model and size for the round. ``views``: a client of its own LoRA rank downloads
        the model at that rank, whole (lossless downlinks only: ``fedgrid.aggregation.lora_ranks``).
        """
        encoded, delta, base_version = downlink.for_client(self._held.get(info.client_id))
        rank = info.lora_rank if views is not None and views.differs(info.lora_rank) else 0
        key = (delta, base_version, None if rank else names, rank)
        if key not in cache:
            if names is not None or rank:
                part = OrderedDict((n, t) for n, t in downlink.base.items() if n in (names or ()))
                encoded = serde.EncodedModel(
                    views.at(rank) if views and rank else part, codec=self.downlink.codec
                )
            head = serde.StreamInfo(
                round=server_round, delta=delta, version=downlink.version, base_version=base_version
            )
            down = list(encoded.frames(head, chunk_size=self.chunk_size))
            # A client applying a difference to the version it holds reaches ``base`` bit for
            # bit (ShadowModel runs the clients' apply_delta), so it holds a copy of ``base``.
            cache[key] = (
                downlink.base if delta else serde.decode_chunks(down)[1],
                sum(serde.wire_size(c) for c in down),
            )
        held, size = cache[key]
        if downlink.version:
            self._held[info.client_id] = downlink.version
        return OrderedDict((k, v.clone()) for k, v in held.items()), size

    def _train(
        self, jobs: list[tuple[ClientInfo, ModelState, FitIns]]
    ) -> list[tuple[Union[FitOutput, Exception], float]]:
        """Phase 2: one outcome per job, a client's exception as its outcome, with the seconds
        it trained (a batched group's seconds split evenly among its clients)."""
        if self._trainer is not None:
            start = self.clock.now()
            batched = self._trainer.fit(
                [(self._index[info.client_id], state, task) for info, state, task in jobs]
            )
            each = (self.clock.now() - start) / max(1, len(batched))
            return [(out, each) for out in batched]
        outcomes: list[tuple[Union[FitOutput, Exception], float]] = []
        for info, state, task in jobs:
            start = self.clock.now()
            try:
                out: Union[FitOutput, Exception] = self._clients[info.client_id].fit(state, task)
            except Exception as exc:  # a client's failure is data for the strategy
                out = exc
            outcomes.append((out, self.clock.now() - start))
        return outcomes

    def fit_round(
        self,
        *,
        server_round: int,
        global_state: ModelState,
        assignments: Sequence[tuple[ClientInfo, FitIns]],
        timeout: timedelta,
        target: int | None = None,
        quorum: Quorum | None = None,
    ) -> RoundOutcome[FitRes]:
        if quorum is not None:  # arrival times decide quorum rounds: simulation replays them
            raise ConfigError("min_quorum", QUORUM_NEEDS_REPLAY)
        downlink = self.downlink.prepare(global_state)
        expected = TensorSpec.of(global_state)
        views = RankViews(downlink.base)
        results: list[FitRes] = []
        failures: list[Failure] = []
        tally = RoundTally()  # as RemoteFleet counts a round (fleet/protocol.py)
        goal = len(assignments) if target is None else target
        pending, seconds = self._available(
            server_round, assignments, failures, keep_fastest=target is not None
        )
        # Clients finish in order: once ``goal`` results are in, the rest are not needed.
        step = 1 if self._trainer is None else self._trainer.clients_per_call
        done = 0
        downloads: dict[_Stream, tuple[ModelState, int]] = {}
        while done < len(pending) and len(results) < goal:
            if stopping():  # between two groups of clients: the round is abandoned (RoundEngine)
                raise InterruptedRunError(f"round {server_round} abandoned: the simulation is stopping")
            group = pending[done : done + min(step, goal - len(results))]
            done += len(group)
            prepared = self._prepare(downlink, server_round, group, downloads, tally, views)  # phase 1
            jobs = [
                (info, state, ins) for info, ins, _, state in prepared if not isinstance(state, Exception)
            ]
            outcomes = iter(self._train(jobs))  # phase 2
            for info, ins, codec, state in prepared:  # phase 3: upload, as the coordinator receives it
                try:
                    if isinstance(state, Exception):
                        raise state
                    out, trained_s = next(outcomes)
                    if isinstance(out, Exception):
                        raise out
                    out = _timed(out, trained_s)
                    results.append(
                        self._upload(
                            server_round, info, ins, codec, state, out, downlink, views, expected, tally
                        )
                    )
                except InterruptedRunError:  # a client's training given up by a stop: no failure
                    raise
                except Exception as exc:  # a client's failure is data for the strategy
                    log.warning("client %s failed in round %d: %s", info.name, server_round, exc)
                    failures.append(Failure(info, f"{type(exc).__name__}: {exc}"))
        cancelled = [info for info, _ in pending[done:]]
        extra = tally.extra()
        if self.profiles is not None:
            extra["sim_round_s"] = max((seconds[r.client.client_id] for r in results), default=0.0)
            results = [simulated_round(r, seconds[r.client.client_id], extra["sim_round_s"]) for r in results]
        return RoundOutcome(
            results, failures, cancelled, bytes_up=tally.bytes_up, bytes_down=tally.bytes_down, extra=extra
        )

    def _available(
        self,
        server_round: int,
        assignments: Sequence[tuple[ClientInfo, FitIns]],
        failures: list[Failure],
        *,
        keep_fastest: bool,
    ) -> tuple[list[tuple[ClientInfo, FitIns]], dict[str, float]]:
        """The assignments of the clients available this round (the others fail), fastest
        first under over-selection, and each one's simulated training seconds."""
        pending: list[tuple[ClientInfo, FitIns]] = []
        seconds: dict[str, float] = {}
        for info, ins in assignments:
            if self.profiles is not None:
                index = self._index[info.client_id]
                if not self.profiles.available(index, server_round):
                    failures.append(Failure(info, f"unavailable in round {server_round} (simulated)"))
                    continue
                seconds[info.client_id] = self.profiles.train_seconds(index, info.num_examples)
            pending.append((info, ins))
        if seconds and keep_fastest:  # over-selection keeps the clients that finish first
            pending.sort(key=lambda a: seconds[a[0].client_id])
        return pending, seconds

    def _prepare(
        self,
        downlink: RoundDownlink,
        server_round: int,
        group: Sequence[tuple[ClientInfo, FitIns]],
        downloads: dict[_Stream, tuple[ModelState, int]],
        tally: RoundTally,
        views: RankViews,
    ) -> list[tuple[ClientInfo, FitIns, CodecSpec, ModelState | Exception]]:
        """Phase 1: each client's uplink codec and downloaded model (or its exception); the task
        it trains on carries the codec, as a deployed client's does."""
        prepared: list[tuple[ClientInfo, FitIns, CodecSpec, ModelState | Exception]] = []
        for info, ins in group:
            try:
                task, codec = protocol.fit_task(self.codec_policy, info, ins)
                names = protocol.download_names(ins, lossless_downlink=self.downlink.lossless, codec=codec)
                state, size = self._download(downlink, server_round, info, downloads, names, views)
                tally.add_down(info.region, size)
                prepared.append((info, task, codec, state))
            except Exception as exc:  # a client's failure is data for the strategy
                prepared.append((info, ins, CodecSpec.NONE, exc))
        return prepared

    def _upload(
        self,
        server_round: int,
        info: ClientInfo,
        ins: FitIns,
        codec: CodecSpec,
        state: ModelState,
        out: FitOutput,
        downlink: RoundDownlink,
        views: RankViews,
        round_specs: Mapping[str, TensorSpec],
        tally: RoundTally,
    ) -> FitRes:
        """Phase 3 for one client (``fedgrid.simulation.upload.upload``), through its own uplink
        encoder; a client of its own LoRA rank uploads factors of that rank."""
        ranked = views.differs(info.lora_rank)
        return upload(
            server_round=server_round,
            info=info,
            ins=ins,
            codec=codec,
            state=state,
            out=out,
            downlink=downlink,
            ranked=views.at(info.lora_rank) if ranked else None,
            round_specs=specs_at_rank(round_specs, info.lora_rank) if ranked else round_specs,
            tally=tally,
            bounds=self.bounds,
            chunk_size=self.chunk_size,
            fast=self.fast_lossless,
            uplink=lambda: self._uplink(info.client_id, codec).begin(server_round, ins.config, info.name),
        )

    def evaluate_round(
        self,
        *,
        server_round: int,
        global_state: ModelState,
        assignments: Sequence[tuple[ClientInfo, EvaluateIns]],
        timeout: timedelta,
    ) -> RoundOutcome[EvaluateRes]:
        """Each client's evaluation, through the simulated wire (``fleet_rounds.evaluate_clients``)."""
        return evaluate_clients(
            self._clients,
            global_state,
            assignments,
            server_round=server_round,
            chunk_size=self.chunk_size,
            bounds=self.bounds,
        )

    def message_round(
        self,
        *,
        server_round: int,
        phase: str,
        assignments: Sequence[tuple[ClientInfo, MessageIns]],
        timeout: timedelta,
    ) -> RoundOutcome[MessageRes]:
        """Each client's ``exchange`` in turn, checked as the coordinator checks it
        (``protocol.check_outbox``), then the relay (``protocol.relay``) and each sender's
        ``receive``: the messages and bytes of a deployment's phase
        (``fleet_rounds.exchange_messages``)."""
        profiles = self.profiles
        return exchange_messages(
            self._clients,
            assignments,
            server_round=server_round,
            phase=phase,
            available=lambda cid: profiles is None or profiles.available(self._index[cid], server_round),
        )


def _timed(out: FitOutput, seconds: float) -> FitOutput:
    """``out`` with a simulated fit's time split (module docstring)."""
    split = Split(wall_s=seconds, compute_s=seconds, comm_s=0.0, wait_s=0.0, transfer_s=0.0)
    return dataclasses.replace(out, metrics=with_split(out.metrics, split))


def simulated_round(result: FitRes, train_s: float, round_s: float) -> FitRes:
    """``result`` with the split of a simulated round (module docstring) in place of its
    measured one: ``train_s`` of compute in a round of ``round_s``, waiting the rest."""
    split = Split(wall_s=round_s, compute_s=train_s, comm_s=0.0, wait_s=round_s - train_s, transfer_s=0.0)
    return dataclasses.replace(result, metrics={**result.metrics, **split.metrics()})
