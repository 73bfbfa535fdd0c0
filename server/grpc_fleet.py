"""``GrpcFleet``: the coordinator's side of the protocol, as plain Python.

It keeps the client registry and the open round, and answers the handlers the servicer
calls (join, poll, download, upload, heartbeat). It raises ``FedgridError`` subclasses; the
servicer maps them to status codes. Every request is validated before it touches state.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
import uuid
from collections import OrderedDict

import torch
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterable, Iterator, Mapping, Sequence

from fedgrid.compression import parse_codec_spec
from fedgrid.compression.feedback import is_delta_tensor, reconstruct
from fedgrid.constants import CHUNK_SIZE, HEARTBEAT_INTERVAL_S, MAX_POLLS_PER_CLIENT, MAX_REASON_CHARS, RETRY_MAX_WAIT_S
from fedgrid.events import EventLog
from fedgrid.errors import (
    AuthenticationError,
    FedgridError,
    DuplicateUpdateError,
    InterruptedRunError,
    InvalidUpdateError,
    ResourceLimitError,
    RunFinishedError,
    StaleTaskError,
)
from fedgrid.proto import serde
from fedgrid.server.fleet import Fleet, RoundOutcome
from fedgrid.server.codec_policy import CodecPolicy
from fedgrid.server.downlink import Downlink, RoundDownlink
from fedgrid.server.spill import UpdateSpill, UpdateWriter
from fedgrid.server.wakeups import Wakeups
from fedgrid.types import ClientInfo, EvaluateIns, EvaluateRes, FitIns, FitRes, Failure, ModelState, TensorSpec

__all__ = ["GrpcFleet", "PollResult"]

log = logging.getLogger(__name__)

#: A client silent for this many heartbeat intervals is considered gone.
SILENCE_INTERVALS = 3.0
#: After a restart, restored clients have the retry backoff cap plus this long to reconnect.
RESTART_GRACE_S = 10.0


@dataclass
class _ClientRecord:
    info: ClientInfo
    token: str
    last_seen: float
    heard_finished: bool = False
    #: The task whose deadline it missed while alive: not selected until it shows it finished
    #: that task (an upload or a failure report for it). Empty: selectable.
    benched_task: str = ""
    polls: int = 0  # long polls it holds now


@dataclass
class _Round:
    server_round: int
    task_id: str
    evaluate: bool  # an evaluation round: clients send metrics, no tensors
    assignments: dict[str, FitIns | EvaluateIns]
    downlink: RoundDownlink  # what clients download; .base is the model they then hold
    global_state: ModelState  # what difference uploads apply to (= downlink.base)
    expected: dict[str, TensorSpec]
    deadline: float
    results: dict[str, FitRes | EvaluateRes] = field(default_factory=dict)
    failures: dict[str, Failure] = field(default_factory=dict)
    uploading: set[str] = field(default_factory=set)
    partials: dict[str, "_Upload"] = field(default_factory=dict)  # broken uploads, by client
    closed: bool = False
    closed_by: str = ""  # why it closed: one of fedgrid.events.CLOSE_REASONS
    bytes_up: int = 0
    bytes_down: int = 0
    raw_up: int = 0  # what the accepted updates would weigh uncompressed
    payload_up: int = 0  # their payload bytes as sent
    parts: dict[frozenset[str], serde.EncodedModel] = field(default_factory=dict)  # partial downloads, by tensors

    def pending(self) -> list[str]:
        return [cid for cid in self.assignments if cid not in self.results and cid not in self.failures]

    def is_pending(self, client_id: str) -> bool:
        """O(1): a long poll asks this on every wake-up, with every client polling."""
        return client_id in self.assignments and client_id not in self.results and client_id not in self.failures


@dataclass
class _Upload:
    """An upload in progress (or broken, awaiting its resume)."""

    asm: serde.ModelAssembler
    writer: UpdateWriter | None
    raw_bytes: int  # its size uncompressed

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()


def _nbytes(spec: TensorSpec) -> int:
    n = torch.empty((), dtype=spec.dtype).element_size()
    for d in spec.shape:
        n *= d
    return n


@dataclass(frozen=True)
class PollResult:
    """What a long poll returns: a task, a hint to poll again, or the end of the run."""

    task_id: str = ""
    server_round: int = 0
    ins: FitIns | EvaluateIns | None = None
    evaluate: bool = False
    deadline_s: float = 0.0
    retry_after_s: float = 0.0
    finished: bool = False


class GrpcFleet(Fleet):
    """Clients reached over gRPC; they pull their tasks.

    Args:
        heartbeat_interval: how often clients report; silence for ``SILENCE_INTERVALS``
            of these drops a client from the round and the registry.
        chunk_size: payload bytes per chunk of model downloads.
        spill_dir: where accepted updates wait for aggregation (see ``server/spill.py``);
            under the state directory they survive a crash. Default: a temporary directory.
        codec_policy: the uplink codec of each client (sent with its task).
        downlink_codec: ``none`` (every client downloads the exact global model, or the
            part of it its task names in ``FitIns.download``) or a lossy spec: clients get
            the compressed change since the version they hold, with server-side error
            feedback (see ``server/downlink.py``), whatever ``FitIns.download`` says.
        events: where the fleet reports joins, drops, accepted uploads and round closes
            (``fedgrid.events``); default: nowhere.
        max_polls_per_client: long polls one client may hold at once; more raise
            ``ResourceLimitError`` (RESOURCE_EXHAUSTED).
        task_scope: part of every task id, so that nested rounds (a global round made of
            regional rounds, each regional round numbered from 1) never share a task id.
    """

    def __init__(
        self,
        *,
        heartbeat_interval: timedelta = timedelta(seconds=HEARTBEAT_INTERVAL_S),
        chunk_size: int = CHUNK_SIZE,
        spill_dir: str | os.PathLike[str] | None = None,
        codec_policy: CodecPolicy | None = None,
        downlink_codec: str = "none",
        events: EventLog | None = None,
        max_polls_per_client: int = MAX_POLLS_PER_CLIENT,
        task_scope: str = "",
    ) -> None:
        self.run_id = uuid.uuid4().hex
        self.events = events if events is not None else EventLog()
        self.max_polls_per_client = max_polls_per_client
        self.task_scope = task_scope
        self.codec_policy = codec_policy or CodecPolicy()
        self.downlink = Downlink(downlink_codec)
        self.spill = UpdateSpill(spill_dir)
        self.heartbeat_interval_s = heartbeat_interval.total_seconds()
        self.chunk_size = chunk_size
        self._clients: dict[str, _ClientRecord] = {}
        self._round: _Round | None = None
        self._finished = False
        self._interrupted = False
        self._lock = threading.RLock()
        self._wake = Wakeups(self._lock)  # keyed: a task wakes its client's poll only

    # -- handlers (called by the servicer) -------------------------------------------------
    def join(self, joining: ClientInfo) -> tuple[ClientInfo, str]:
        """Registers a client (its ``client_id`` is assigned here); returns its info and session token."""
        if self._finished:
            raise RunFinishedError("the run is over")
        info = dataclasses.replace(joining, client_id=uuid.uuid4().hex[:16])
        token = secrets.token_urlsafe(24)
        with self._lock:
            # A restarted client rejoins under its name: its old session goes, no ghost stays.
            ghosts = [cid for cid, rec in self._clients.items() if info.name and rec.info.name == info.name]
            for cid in ghosts:
                self._remove(cid, "replaced by a new session of the same name")
            self._clients[info.client_id] = _ClientRecord(info, token, time.monotonic())
            self._wake.notify("registry")
        for cid in ghosts:
            log.info("client %r rejoined: session %s replaced", info.name, cid)
            self.events.emit("client_left", client=cid, reason="replaced by a new session of the same name")
        log.info("client %r joined as %s (region %r, %d examples)", info.name, info.client_id, info.region, info.num_examples)
        self.events.emit("client_joined", client=info.client_id, name=info.name, region=info.region)
        return info, token

    def authenticate(self, client_id: str, token: str) -> _ClientRecord:
        """Returns the client's record and marks it alive.

        Raises:
            AuthenticationError: unknown client or wrong token.
        """
        with self._lock:
            record = self._clients.get(client_id)
            if record is None:
                raise AuthenticationError(f"unknown client {client_id!r}")
            if not secrets.compare_digest(record.token.encode(), token.encode()):
                raise AuthenticationError(f"bad session token for client {client_id!r}")
            record.last_seen = time.monotonic()
            return record

    def _remove(self, client_id: str, reason: str) -> None:
        """Drops a client from the registry, and from the open round as a failure (lock held)."""
        record = self._clients.pop(client_id)
        rnd = self._round
        if rnd is not None and not rnd.closed and rnd.is_pending(client_id):
            rnd.failures[client_id] = Failure(record.info, reason)
            self._wake.notify("round")
            partial = rnd.partials.pop(client_id, None)
            if partial is not None:
                partial.abort()

    @staticmethod
    def _reason(text: str) -> str:
        if len(text) > MAX_REASON_CHARS:
            raise InvalidUpdateError(f"reason: {len(text)} characters, at most {MAX_REASON_CHARS}")
        return text

    def report_failure(self, client_id: str, token: str, task_id: str, reason: str) -> None:
        """The client's ``fit`` or ``evaluate`` raised: its task fails at once with ``reason``.

        Raises:
            AuthenticationError, StaleTaskError: unknown session, or no open task ``task_id``.
            DuplicateUpdateError: its result for the task was already accepted.
            InvalidUpdateError: an oversized reason (nothing recorded).
        """
        reason = self._reason(reason)
        record = self.authenticate(client_id, token)
        with self._lock:
            if record.benched_task == task_id:  # it finished the task it was benched for
                record.benched_task = ""
            rnd = self._open_task(client_id, task_id)
            if client_id in rnd.results:
                raise DuplicateUpdateError(f"result for round {rnd.server_round} from client {client_id!r} already accepted")
            rnd.failures.setdefault(client_id, Failure(record.info, f"client reported: {reason}"))
            self._wake.notify("round")
        log.warning("round %d: client %r reported a failure: %r", rnd.server_round, record.info.name or client_id, reason)
        self.events.emit("failure_reported", round=rnd.server_round, client=client_id, reason=reason)

    def leave(self, client_id: str, token: str, reason: str) -> None:
        """The client is going (stopped, interrupted, crashed): removed at once, its open task failed.

        Raises:
            AuthenticationError: unknown session.
            InvalidUpdateError: an oversized reason (nothing changed).
        """
        reason = self._reason(reason)
        record = self.authenticate(client_id, token)
        with self._lock:
            if client_id in self._clients:
                self._remove(client_id, f"client left: {reason}")
            self._wake.notify("registry", ("poll", client_id))
        log.info("client %r left: %r", record.info.name or client_id, reason)
        self.events.emit("client_left", client=client_id, reason=reason)

    def heartbeat(self, client_id: str, token: str) -> float:
        self.authenticate(client_id, token)
        return self.heartbeat_interval_s

    def _poll_now(self, record: _ClientRecord) -> PollResult | None:
        """The poll's answer if there is one now (lock held)."""
        if self._finished:
            record.heard_finished = True
            self._wake.notify("finish")
            return PollResult(finished=True)
        if self._interrupted:  # stopping: answer now, before the server cancels the call
            return PollResult(retry_after_s=1.0)
        rnd = self._round
        client_id = record.info.client_id
        if rnd is not None and not rnd.closed and rnd.is_pending(client_id):
            return PollResult(
                task_id=rnd.task_id,
                evaluate=rnd.evaluate,
                server_round=rnd.server_round,
                ins=rnd.assignments[client_id],
                deadline_s=max(0.0, rnd.deadline - time.monotonic()),
            )
        return None

    async def poll_async(self, client_id: str, token: str, wait_s: float) -> PollResult:
        """Long poll: waits up to ``wait_s`` for a task for this client, woken only by what
        concerns it (its task, the end of the run, a stop); the wait holds no thread.

        Raises:
            AuthenticationError: unknown session.
            ResourceLimitError: the client already holds ``max_polls_per_client`` polls.
        """
        record = self.authenticate(client_id, token)
        deadline = time.monotonic() + max(0.0, min(wait_s, 60.0))
        answer: list[PollResult] = []

        def ready() -> bool:
            result = self._poll_now(record)
            if result is not None:
                answer.append(result)
            return result is not None

        with self._lock:
            if record.polls >= self.max_polls_per_client:
                raise ResourceLimitError(f"client {client_id!r} already holds {record.polls} long polls (limit {self.max_polls_per_client})")
            record.polls += 1
        try:
            while True:
                await self._wake.wait_async(("poll", client_id), deadline - time.monotonic(), ready)
                if answer:
                    return answer[0]
                with self._lock:
                    record.last_seen = time.monotonic()
                if time.monotonic() >= deadline:
                    return PollResult(retry_after_s=0.0)
        finally:
            with self._lock:
                record.polls -= 1

    def _open_task(self, client_id: str, task_id: str) -> _Round:
        rnd = self._round
        if rnd is None or rnd.task_id != task_id:
            raise StaleTaskError(f"task {task_id!r} is not open (round closed or unknown)")
        if rnd.closed:
            raise StaleTaskError(f"round {rnd.server_round} is closed")
        if client_id not in rnd.assignments:
            raise StaleTaskError(f"client {client_id!r} has no task in round {rnd.server_round}")
        return rnd

    def download(self, client_id: str, token: str, task_id: str, have_version: int | None = None) -> Iterator[bytes]:
        """The model of the client's open task, as a chunk stream: whole, or the tensors its task
        names (``FitIns.download``) on a lossless downlink, or on a compressed downlink the
        change since ``have_version`` when the client holds the previous version."""
        self.authenticate(client_id, token)
        with self._lock:
            rnd = self._open_task(client_id, task_id)
        names = self._download_names(rnd.assignments[client_id])
        if names is None:
            encoded, delta, base_version = rnd.downlink.for_client(have_version)
        else:
            encoded, delta, base_version = self._part(rnd, names), False, 0
        info = serde.StreamInfo(
            run_id=self.run_id, task_id=task_id, round=rnd.server_round, delta=delta, version=rnd.downlink.version, base_version=base_version
        )
        return self._count_down(rnd, encoded.frames(info, chunk_size=self.chunk_size))

    def _download_names(self, ins: FitIns | EvaluateIns) -> frozenset[str] | None:
        if not isinstance(ins, FitIns):
            return None
        codec = str(ins.config.get("uplink_codec", "none"))
        # An uplink sending differences takes them against the global values of what it uploads.
        return ins.download_names(lossless_downlink=self.downlink.lossless, delta_uplink=not parse_codec_spec(codec, key="codec").lossless)

    def _part(self, rnd: _Round, names: frozenset[str]) -> serde.EncodedModel:
        """The tensors ``names`` of the round's exact model, encoded once per round and set of
        tensors (two clients racing may both encode it; one copy is kept)."""
        with self._lock:
            part = rnd.parts.get(names)
        if part is None:
            part = serde.EncodedModel(OrderedDict((n, t) for n, t in rnd.global_state.items() if n in names), codec=self.downlink.codec)
            with self._lock:
                part = rnd.parts.setdefault(names, part)
        return part

    def _count_down(self, rnd: _Round, frames: Iterator[bytes]) -> Iterator[bytes]:
        sent = 0
        try:
            for frame in frames:
                sent += serde.wire_size(frame)
                yield frame
        finally:
            with self._lock:
                rnd.bytes_down += sent

    def upload(self, frames: Iterable[bytes]) -> int:
        """Receives one update stream; returns the payload bytes accepted.

        Raises:
            InvalidUpdateError: malformed stream or tensors (state unchanged).
            AuthenticationError, StaleTaskError, DuplicateUpdateError: as named.
        """
        iterator = iter(frames)
        first = next(iterator, None)
        if first is None:
            raise InvalidUpdateError("empty upload stream: no header")
        header = serde.read_header(first)
        record = self.authenticate(header.client_id, header.session_token)
        client_id = record.info.client_id
        with self._lock:
            current = self._round
            if current is not None and current.task_id == header.task_id and client_id in current.results:
                # Checked before "closed": a retry whose first attempt landed learns it did.
                raise DuplicateUpdateError(f"update for round {current.server_round} from client {client_id!r} already accepted")
            if record.benched_task == header.task_id:  # late, but it did finish that task
                record.benched_task = ""
            rnd = self._open_task(client_id, header.task_id)
            if client_id in rnd.uploading:
                raise DuplicateUpdateError(f"an upload for round {rnd.server_round} from client {client_id!r} is in progress")
            rnd.uploading.add(client_id)
        upload: _Upload | None = None
        try:
            with self._lock:
                partial = rnd.partials.pop(client_id, None)
            if header.resume_from_chunk:
                if partial is None or partial.asm.frames_received != header.resume_from_chunk:
                    held = 0 if partial is None else partial.asm.frames_received
                    if partial is not None:
                        with self._lock:
                            rnd.partials[client_id] = partial
                    raise StaleTaskError(f"cannot resume at chunk {header.resume_from_chunk}: the coordinator holds {held} chunks of this upload")
                upload = partial
            else:
                if partial is not None:
                    partial.abort()
                upload = self._start_upload(rnd, record.info, header)
                upload.asm.feed(first)
            asm = upload.asm
            try:
                for frame in iterator:
                    asm.feed(frame)
            except FedgridError:
                raise  # bad input: nothing kept
            except Exception:
                # The connection broke: keep what arrived so that the client resumes from it.
                with self._lock:
                    if not rnd.closed:
                        rnd.partials[client_id] = upload
                        upload = None  # kept, not aborted
                log.info("round %d: upload from %r broke after %d chunks; kept for resume",
                         rnd.server_round, record.info.name or client_id, asm.frames_received)
                self.events.emit("upload_broken", round=rnd.server_round, client=client_id, chunks=asm.frames_received)
                raise
            stream, state = asm.finish()
            if stream.round != rnd.server_round:
                raise InvalidUpdateError(f"header names round {stream.round}, the task is round {rnd.server_round}")
            result: FitRes | EvaluateRes
            if rnd.evaluate:
                result = EvaluateRes(record.info, stream.num_examples, dict(stream.metrics))
            elif upload.writer is not None:  # tensors were reconstructed, checked and written as they came
                result = FitRes(record.info, upload.writer.commit(), stream.num_examples, dict(stream.metrics))  # type: ignore[arg-type]
            else:
                state = reconstruct(rnd.global_state, state, delta=stream.delta)
                serde.check_finite(state)
                result = self.spill.put(task_id=rnd.task_id, result=FitRes(record.info, state, stream.num_examples, dict(stream.metrics)))
            del state
            with self._lock:
                if rnd.closed or self._round is not rnd:
                    if not rnd.evaluate:
                        self.spill.discard(task_id=rnd.task_id, client_id=client_id)
                    raise StaleTaskError(f"round {rnd.server_round} closed before the upload completed")
                if rnd.evaluate and stream.num_examples < 1:
                    rnd.failures[client_id] = Failure(record.info, "evaluated no examples")
                else:
                    rnd.results[client_id] = result
                rnd.bytes_up += asm.wire_bytes
                rnd.payload_up += asm.payload_bytes
                rnd.raw_up += upload.raw_bytes
                self._wake.notify("round")
                accepted, expected = len(rnd.results), len(rnd.assignments)
            log.info("round %d: accepted %s from %r (%d of %d)", rnd.server_round, "evaluation" if rnd.evaluate else "update",
                     record.info.name or client_id, accepted, expected)
            self.events.emit("update_accepted", round=rnd.server_round, client=client_id, evaluate=rnd.evaluate, accepted=accepted, expected=expected)
            upload = None
            return asm.payload_bytes
        finally:
            if upload is not None:  # rejected: drop what was written
                upload.abort()
            with self._lock:
                rnd.uploading.discard(client_id)
                self._wake.notify("round", ("upload", client_id))

    def _start_upload(self, rnd: _Round, client: ClientInfo, header: serde.StreamInfo) -> _Upload:
        """An assembler for a new upload; fit updates stream into their spill file."""
        ins = rnd.assignments[client.client_id]
        # The expected specs bound every allocation; an evaluation carries no tensors.
        expected: Mapping[str, TensorSpec] = {} if rnd.evaluate else (getattr(ins, "expected", None) or rnd.expected)
        raw = sum(_nbytes(spec) for spec in expected.values())
        if rnd.evaluate:
            return _Upload(serde.ModelAssembler(expected=expected), None, raw)
        if header.num_examples < 1:
            raise InvalidUpdateError("num_examples must be at least 1")
        writer = self.spill.writer(task_id=rnd.task_id, client=client, specs=expected, num_examples=header.num_examples,
                                   metrics=header.metrics)
        if writer is None:
            return _Upload(serde.ModelAssembler(expected=expected), None, raw)
        base = rnd.global_state

        def sink(name: str, tensor: torch.Tensor) -> None:
            value = base[name] + tensor if header.delta and is_delta_tensor(tensor) else tensor
            serde.check_finite({name: value})
            writer.write(name, value)

        return _Upload(serde.ModelAssembler(expected=expected, sink=sink), writer, raw)

    def upload_status(self, client_id: str, token: str, task_id: str) -> tuple[int, bool]:
        """(chunks of a broken upload the coordinator holds, whether the update already landed)."""
        self.authenticate(client_id, token)
        with self._lock:
            rnd = self._round
            if rnd is not None and rnd.task_id == task_id and client_id in rnd.results:
                return 0, True
            rnd = self._open_task(client_id, task_id)
            # A broken stream may still be winding down on its server thread: let it settle.
            deadline = time.monotonic() + 5.0
            while client_id in rnd.uploading and time.monotonic() < deadline:
                self._wake.wait(("upload", client_id), deadline - time.monotonic())
            if client_id in rnd.results:
                return 0, True
            partial = rnd.partials.get(client_id)
            return (0 if partial is None else partial.asm.frames_received), False

    @property
    def task_scope(self) -> str:
        """Part of every task id (set it before a round, e.g. ``g7`` for global round 7)."""
        return self._task_scope

    @task_scope.setter
    def task_scope(self, scope: str) -> None:
        if len(scope) > 64 or not all(ch.isascii() and (ch.isalnum() or ch in "-_.") for ch in scope):
            raise ValueError(f"task_scope must be at most 64 of [A-Za-z0-9._-], got {scope!r}")
        self._task_scope = scope

    def polls_held(self, client_id: str) -> int:
        """Long polls ``client_id`` holds now (0 for an unknown client)."""
        with self._lock:
            record = self._clients.get(client_id)
            return 0 if record is None else record.polls

    @property
    def current_round(self) -> _Round | None:
        """The round in progress, or closed and not yet committed (``None`` between rounds).

        For status pages and tests: read it, never change it.
        """
        return self._round

    # -- Fleet -----------------------------------------------------------------------------
    def _live(self) -> list[ClientInfo]:
        now = time.monotonic()
        limit = SILENCE_INTERVALS * self.heartbeat_interval_s
        # A client holding a long poll is alive however long the poll (its connection is
        # watched by keepalive pings); heartbeats cover the time it trains.
        gone = [cid for cid, rec in self._clients.items() if now - rec.last_seen > limit and rec.polls == 0]
        for cid in gone:
            log.warning("client %r silent for over %.1fs: dropped", self._clients[cid].info.name or cid, limit)
            del self._clients[cid]
            self.events.emit("client_dropped", client=cid, reason=f"silent for over {limit:.1f}s")
        return [rec.info for rec in self._clients.values()]

    def live_clients(self) -> list[ClientInfo]:
        """Every client heartbeating, benched ones included (``wait_for_clients`` leaves those out)."""
        with self._lock:
            return self._live()

    def _selectable(self) -> list[ClientInfo]:
        live = self._live()
        return [info for info in live if not self._clients[info.client_id].benched_task]

    def wait_for_clients(self, *, min_clients: int, timeout: timedelta) -> list[ClientInfo]:
        """The selectable clients (live, and not benched for a missed deadline), once there
        are ``min_clients`` of them."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._lock:
            while True:
                live = self._selectable()
                if len(live) >= min_clients:
                    return live
                if self._interrupted:
                    raise InterruptedRunError("stopped while waiting for clients")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    benched = len(self._clients) - len(live)
                    raise TimeoutError(
                        f"{len(live)} live clients after {timeout.total_seconds():.0f}s, need {min_clients}"
                        + (f" ({benched} more benched after missing a deadline)" if benched else "")
                    )
                self._wake.wait("registry", min(remaining, self.heartbeat_interval_s))

    def fit_round(
        self,
        *,
        server_round: int,
        global_state: ModelState,
        assignments: Sequence[tuple[ClientInfo, FitIns]],
        timeout: timedelta,
        target: int | None = None,
    ) -> RoundOutcome[FitRes]:
        results, failures, cancelled, rnd = self._run(server_round, global_state, assignments, timeout, evaluate=False, target=target)
        extra = {"uplink_ratio": rnd.raw_up / rnd.payload_up} if rnd.payload_up else {}
        return RoundOutcome(
            [r for r in results if isinstance(r, FitRes)], failures, cancelled, bytes_up=rnd.bytes_up, bytes_down=rnd.bytes_down, extra=extra,
            closed_by=rnd.closed_by,
        )

    def evaluate_round(
        self,
        *,
        server_round: int,
        global_state: ModelState,
        assignments: Sequence[tuple[ClientInfo, EvaluateIns]],
        timeout: timedelta,
    ) -> RoundOutcome[EvaluateRes]:
        results, failures, cancelled, rnd = self._run(server_round, global_state, assignments, timeout, evaluate=True)
        return RoundOutcome(
            [r for r in results if isinstance(r, EvaluateRes)], failures, cancelled, bytes_up=rnd.bytes_up, bytes_down=rnd.bytes_down,
            closed_by=rnd.closed_by,
        )

    def _run(
        self,
        server_round: int,
        global_state: ModelState,
        assignments: Sequence[tuple[ClientInfo, FitIns | EvaluateIns]],
        timeout: timedelta,
        *,
        evaluate: bool,
        target: int | None = None,
    ) -> tuple[list[FitRes | EvaluateRes], list[Failure], list[ClientInfo], _Round]:
        """Opens a task for the assigned clients and closes it when ``target`` (default: all)
        reported, the rest failed or went silent, or the deadline passed."""
        # Evaluation judges the exact global model; fit rounds go through the downlink policy.
        downlink = RoundDownlink(base=global_state, version=0, _full=serde.EncodedModel(global_state)) if evaluate else self.downlink.prepare(global_state)
        rnd = _Round(
            server_round=server_round,
            # Deterministic: a round redone after a restart has the same task id, so a client's
            # retried upload of that round (same seed, same bits) is accepted.
            task_id=f"{self.run_id[:12]}-{self.task_scope + '-' if self.task_scope else ''}r{server_round}-{'evaluate' if evaluate else 'fit'}",
            evaluate=evaluate,
            assignments={info.client_id: self._with_codec(info, ins) for info, ins in assignments},
            downlink=downlink,
            global_state=downlink.base,
            expected=TensorSpec.of(global_state),
            deadline=time.monotonic() + timeout.total_seconds(),
        )
        infos = {info.client_id: info for info, _ in assignments}
        if not evaluate:
            # Updates that landed before a restart are not asked for again.
            rnd.results.update(self.spill.restore(task_id=rnd.task_id, assigned=infos))
            if rnd.results:
                log.info("round %d: %d updates restored from before a restart", server_round, len(rnd.results))
                self.events.emit("updates_restored", round=server_round, count=len(rnd.results))
        self.events.emit("round_opened", round=server_round, task=rnd.task_id, clients=len(rnd.assignments), evaluate=evaluate)
        with self._lock:
            self._round = rnd
            self._wake.notify(*(("poll", cid) for cid in rnd.assignments))  # only the clients with a task
            goal = len(rnd.assignments) if target is None else min(target, len(rnd.assignments))
            reason = "all"
            while rnd.pending() and len(rnd.results) < goal:
                if self._interrupted:
                    for cid in rnd.pending():
                        rnd.failures[cid] = Failure(infos[cid], "coordinator stopping")
                    reason = "stopping"
                    break
                now = time.monotonic()
                if now >= rnd.deadline:
                    for cid in rnd.pending():
                        rnd.failures[cid] = Failure(infos[cid], f"missed the round deadline of {timeout.total_seconds():.1f}s")
                        if cid in self._clients and cid not in rnd.uploading:  # alive, yet no result: benched
                            self._clients[cid].benched_task = rnd.task_id
                    reason = "deadline"
                    break
                live = {info.client_id for info in self._live()}
                for cid in rnd.pending():
                    if cid not in live and cid not in rnd.uploading:
                        rnd.failures[cid] = Failure(infos[cid], "client went silent (no heartbeat)")
                self._wake.wait("round", min(rnd.deadline - now, self.heartbeat_interval_s))
            rnd.closed = True  # late uploads are refused from here on
            for partial in rnd.partials.values():
                partial.abort()
            rnd.partials.clear()
            results = [rnd.results[cid] for cid in rnd.assignments if cid in rnd.results]
            failures = [rnd.failures[cid] for cid in rnd.assignments if cid in rnd.failures]
            cancelled = [infos[cid] for cid in rnd.pending()]  # over-selected, not needed
            if reason == "all" and cancelled:
                reason = "target"
            rnd.closed_by = reason
        self.spill.flush()  # held updates reach their files before the strategy sees them (server/spill.py)
        self.events.emit("round_closed", round=server_round, evaluate=evaluate, reason=reason, results=len(results), failures=len(failures))
        return results, failures, cancelled, rnd

    def _with_codec(self, info: ClientInfo, ins: FitIns | EvaluateIns) -> FitIns | EvaluateIns:
        if isinstance(ins, EvaluateIns):
            return ins
        return dataclasses.replace(ins, config={**ins.config, "uplink_codec": self.codec_policy.uplink(info)})

    def committed(self, server_round: int) -> None:
        with self._lock:
            if self._round is not None and self._round.closed:
                self._round = None  # frees the round's models and results
        self.spill.clear()

    def close(self) -> None:
        self.spill.close()

    def interrupt(self) -> None:
        with self._lock:
            self._interrupted = True
            if self._round is not None:
                self._round.closed = True  # in-flight uploads are refused cleanly
            self._wake.notify_all()

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            clients = [{**dataclasses.asdict(r.info), "token": r.token, "benched_task": r.benched_task} for r in self._clients.values()]
        return {"run_id": self.run_id, "clients": clients, "downlink": self.downlink.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the run id and registry: clients keep their sessions across a restart.

        Restored clients get a grace period before silence counts against them: they may be
        sleeping in retry backoff (capped at ``RETRY_MAX_WAIT_S``) while the coordinator restarts.
        """
        now = time.monotonic() + RETRY_MAX_WAIT_S + RESTART_GRACE_S
        with self._lock:
            self.run_id = str(state["run_id"])
            if state.get("downlink") is not None:
                self.downlink.load_state_dict(state["downlink"])
            self._clients = {}
            for entry in state["clients"]:
                fields = {k: v for k, v in entry.items() if k not in ("token", "benched_task")}
                info = ClientInfo(**{**fields, "codecs": tuple(fields.get("codecs", ("none",)))})
                self._clients[info.client_id] = _ClientRecord(info, str(entry["token"]), now, benched_task=str(entry.get("benched_task", "")))
            self._wake.notify_all()

    def finish(self, *, timeout: timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        with self._lock:
            self._finished = True
            self._wake.notify_all()
            while True:
                waiting = [r for r in self._clients.values() if not r.heard_finished]
                live = {info.client_id for info in self._live()}
                waiting = [r for r in waiting if r.info.client_id in live]
                remaining = deadline - time.monotonic()
                if not waiting or remaining <= 0:
                    return
                self._wake.wait("finish", min(remaining, 0.5))
