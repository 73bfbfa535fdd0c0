"""The client's gRPC runtime: join, long-poll for tasks, download, train, upload.

Every RPC has a deadline. Transient failures (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED) are retried
with exponential backoff and jitter, bounded in time; other errors surface with the
server's message. ``run`` blocks; ``start`` runs the same loop in a background thread.

With a ``state_path``, what the client keeps across rounds (the uplink's error-feedback
residuals, the ``Client``'s own ``state_dict``) is written there after every fit task,
atomically, and restored when a client of the same name rejoins the same run, so a restarted
client process carries on where it stopped.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import grpc
import tenacity
import torch

from fedgrid.client.api import Client
from fedgrid.client.state import load_client_state, restore_client_state, save_client_state
from fedgrid.client.uplink import UplinkEncoder
from fedgrid.constants import (
    CONNECT_TIMEOUT_S,
    MAX_MESSAGE_BYTES,
    POLL_WAIT_S,
    RETRY_MAX_ELAPSED_S,
    RETRY_MAX_WAIT_S,
    RPC_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
)
from fedgrid.compression import available_codecs
from fedgrid.compression.feedback import apply_delta
from fedgrid.errors import FedgridError, InvalidUpdateError
from fedgrid.constants import MAX_REASON_CHARS
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc
from fedgrid.proto import serde
from fedgrid.proto.tls import TLSFiles, channel_credentials, session_metadata
from fedgrid.pki import identity_of
from fedgrid.types import EVALUATE, FIT, FitIns, ModelState, Scalar

__all__ = [
    "Connection", "ClientHandle", "RunSummary", "TaskReport", "ClientEvent", "TaskStep", "TaskFeed", "RpcFailed", "CoordinatorUnreachable",
    "run", "start", "TRANSIENT", "check_target",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
#: Consecutive refused sessions after which the client gives up instead of joining again.
MAX_REJOINS = 3
SERVICE = "fedgrid.v1.Coordinator"
#: Retried with backoff. CANCELLED too: a coordinator shutting down cancels calls in flight
#: (a call this client cancels itself ends the loop through ``stop`` instead).
#: RESOURCE_EXHAUSTED too: the coordinator is at a limit (transfers in flight) for now.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED})
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Each client its own connection, also when a program embeds many: channels with the
    # same target would otherwise share one, and its stream limit, and fail together.
    ("grpc.use_local_subchannel_pool", 1),
]
#: Tag of a client state file (``run(..., state_path=...)``); a file without it is not loaded.


class RpcFailed(FedgridError):
    """An RPC failed with a non-transient status, or retries ran out. ``code`` is the status."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method} failed: {code.name}: {details}")
        self.code = code
        self.details = details


class CoordinatorUnreachable(RpcFailed):
    """The client never reached its coordinator within the connect deadline."""

    def __init__(self, target: str, deadline_s: float, code: grpc.StatusCode, details: str, tls: bool) -> None:
        RpcFailed.__init__(self, "Join", code, details)
        check_tls = ("the coordinator accepts this client's certificate (--ca, --cert, --key)" if tls else
                     "the coordinator serves plaintext (one with mutual TLS needs --ca, --cert and --key)")
        self.args = (f"could not reach the coordinator at {target} within {deadline_s:g}s ({code.name}: {_one_line(details)}): "
                     f"check that it is running, that {target} is its address and port (RUN_DIR/address), and that {check_tls}",)


def check_target(target: str, *, what: str = "coordinator") -> str:
    """``target`` if it is ``HOST:PORT`` with a port in 1..65535 (``[::1]:PORT`` for IPv6).

    gRPC reads a bare host as port 443 and other odd forms as name-resolver schemes: a
    typo would dial something else and retry there for as long as the deadline allows.

    Raises:
        ValueError: not of that form (the message names ``what`` and the expected form).
    """
    host, sep, port = target.rpartition(":")
    if not sep or not host or host.endswith(":") and not host.startswith("["):
        raise ValueError(f"{what} address {target!r} has no port: expected HOST:PORT, e.g. 127.0.0.1:50051")
    if not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{what} address {target!r} has port {port!r}: expected HOST:PORT with a port in 1..65535")
    return target


def _identity(cert: str) -> str:
    """The identity of the certificate in file ``cert``.

    Raises:
        ValueError: the file holds no client certificate, or one without a valid identity (named).
    """
    try:
        return identity_of(Path(cert).read_bytes())
    except ValueError as exc:
        raise ValueError(f"certificate {cert}: {exc}") from None


def _one_line(text: str) -> str:
    """gRPC's details can span lines (its debug string): one line for a log or an error."""
    return " ".join(text.split())


def _describe(exc: BaseException | None) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {_one_line(exc.details() or '')}"
    return _one_line(f"{type(exc).__name__}: {exc}") if exc is not None else ""


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() in TRANSIENT


@dataclass(frozen=True)
class UploadAttempt:
    """One try at an upload: the chunk it started from and the bytes it sent (``sent[0]``)."""

    start_chunk: int
    sent: list[int]

    @property
    def bytes_sent(self) -> int:
        return self.sent[0]


@dataclass(frozen=True)
class TaskReport:
    """One task the client finished and uploaded, for an observer (``run``'s ``on_task``).

    Attributes:
        round: the coordinator's round.
        kind: ``fit`` or ``evaluate``.
        num_examples: examples the result claims.
        loss: the result's ``loss`` or ``train_loss`` metric, if it has one.
        bytes_up: wire bytes (``serde.wire_size``, as the coordinator counts them) sent for
            the upload, every try included.
        bytes_down: wire bytes received for the task's model download.
        upload_retries: tries of the upload after the first.
    """

    round: int
    kind: str
    num_examples: int
    loss: float | None
    bytes_up: int
    bytes_down: int
    upload_retries: int


@dataclass(frozen=True)
class ClientEvent:
    """A change of the client's session, for an observer (``run``'s ``on_event``).

    Attributes:
        kind: ``joined`` (``client_id``, ``run_id``; again after a refused session),
            ``polling`` (waiting for a task), ``task`` (``round``, ``task``: ``fit``,
            ``evaluate`` or ``message``), ``error`` (``round``, ``detail``: the task failed or
            its round closed first; the client goes on), ``finished`` (the run ended) or
            ``left`` (``detail``: why this client stopped).
    """

    kind: str
    round: int = 0
    task: str = ""
    client_id: str = ""
    run_id: str = ""
    detail: str = ""


@dataclass(frozen=True)
class RunSummary:
    """What ``run`` returns: rounds trained and the client's id."""

    client_id: str
    rounds: int


class Connection:
    """One client's session with a coordinator: typed calls with deadlines and retries.

    Args:
        target: ``HOST:PORT`` of the coordinator.
        rpc_timeout: deadline of unary calls, seconds.
        transfer_timeout: deadline of model downloads and uploads, seconds.
        retry_max_elapsed: stop retrying a transient failure after this many seconds.
        connect_timeout: until the first call succeeds (``join``), give up retrying after
            this many seconds, with ``CoordinatorUnreachable`` naming the address.
        retry_max_wait: cap of the backoff between attempts.
        stop: when set, retries stop early.
        tls: the CA bundle to trust and this client's certificate and key: the connection is
            then mutual TLS, and the client is the identity of its certificate (it joins
            without a name of its own). ``None``: plaintext.
        server_name: the name the coordinator's certificate must hold, when it is not the
            host of ``target`` (an IP address, a tunnel).
    """

    def __init__(
        self,
        target: str,
        *,
        rpc_timeout: float = RPC_TIMEOUT_S,
        transfer_timeout: float = TRANSFER_TIMEOUT_S,
        retry_max_elapsed: float = RETRY_MAX_ELAPSED_S,
        retry_max_wait: float = RETRY_MAX_WAIT_S,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        stop: threading.Event | None = None,
        tls: TLSFiles | None = None,
        server_name: str = "",
    ) -> None:
        self.target = check_target(target)
        self.connect_timeout = connect_timeout
        #: Whether a call ever got an answer from the coordinator.
        self.reached = False
        self.tls = tls
        #: Under mTLS, the identity of this client's certificate: its name to the coordinator.
        self.identity = _identity(tls.cert) if tls is not None else None
        #: The name the coordinator knows this client by (set by ``join``).
        self.name = self.identity or ""
        if tls is None:
            self.channel = grpc.insecure_channel(target, options=GRPC_OPTIONS)
        else:
            options = [*GRPC_OPTIONS, ("grpc.ssl_target_name_override", server_name)] if server_name else GRPC_OPTIONS
            self.channel = grpc.secure_channel(target, channel_credentials(tls), options=options)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        # The chunk streams carry encoded Chunk messages as bytes (see server/service.py).
        self._download = self.channel.unary_stream(
            f"/{SERVICE}/DownloadModel", request_serializer=pb.DownloadRequest.SerializeToString, response_deserializer=None
        )
        self._upload = self.channel.stream_unary(
            f"/{SERVICE}/UploadUpdate", request_serializer=None, response_deserializer=pb.UploadReply.FromString
        )
        self.rpc_timeout = rpc_timeout
        self.transfer_timeout = transfer_timeout
        self.stop = stop or threading.Event()
        self._retry_max_elapsed = retry_max_elapsed
        self._retry_max_wait = retry_max_wait
        self.client_id = ""
        self.token = ""
        #: Whether a long poll is in flight (the heartbeat is then not needed).
        self.polling = False
        self.run_id = ""
        self.heartbeat_interval_s = 5.0
        self.chunk_size = serde.CHUNK_SIZE
        #: The tries of the latest upload (a resumed upload has more than one).
        self.upload_attempts: list[UploadAttempt] = []
        #: Wire bytes (``serde.wire_size``, as the coordinator counts them) of the model
        #: downloads and the uploads so far, every try included.
        self.bytes_down = 0
        self.bytes_up = 0
        #: The model the client holds and its downlink version (compressed downlinks).
        self.held: ModelState | None = None
        self.held_version: int | None = None
        #: Uplink encoders by codec: their error-feedback residuals persist across rounds.
        self._uplinks: dict[str, UplinkEncoder] = {}

    def close(self) -> None:
        self.channel.close()

    def _session(self) -> Sequence[tuple[str, str]]:
        return session_metadata(self.token)

    def uplink_state_dict(self) -> dict[str, dict[str, Any]]:
        """Every uplink encoder's state (its error-feedback residuals), by codec spec."""
        return {codec: encoder.state_dict() for codec, encoder in self._uplinks.items()}

    def load_uplink_state_dict(self, states: Mapping[str, Mapping[str, Any]]) -> None:
        """Replaces the uplink encoders with those of ``uplink_state_dict()``, all or none.

        Raises:
            ConfigError: a codec spec that does not parse or is not contractive.
            ValueError, KeyError, TypeError, AttributeError: a state that is not an encoder's.
        """
        uplinks = {}
        for codec, state in states.items():
            uplinks[codec] = UplinkEncoder(codec)
            uplinks[codec].load_state_dict(state)
        self._uplinks = uplinks

    def _call(self, method: str, fn: Callable[[], T]) -> T:
        """Calls ``fn``, retrying transient failures with jittered exponential backoff."""
        connecting = not self.reached
        budget = min(self.connect_timeout, self._retry_max_elapsed) if connecting else self._retry_max_elapsed
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_is_transient),
            wait=tenacity.wait_random_exponential(multiplier=0.2, max=self._retry_max_wait),
            stop=tenacity.stop_after_delay(budget) | tenacity.stop_when_event_set(self.stop),
            before_sleep=lambda rs: log.info("retrying %s on %s: %s", method, self.target, _describe(rs.outcome.exception() if rs.outcome else None)),
            reraise=True,
        )
        try:
            result = retrying(fn)
        except grpc.RpcError as exc:
            details = (exc.details() or "") + self._hint(exc)
            if connecting and _is_transient(exc) and not self.stop.is_set():
                raise CoordinatorUnreachable(self.target, budget, exc.code(), details, self.tls is not None) from exc
            raise RpcFailed(method, exc.code(), _one_line(details)) from exc
        self.reached = True
        return result

    def _hint(self, exc: grpc.RpcError) -> str:
        """What a connection closed at the TLS handshake most likely means: the client only
        sees the socket close (the coordinator's reason stays in its own log)."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE or "Socket closed" not in (exc.details() or ""):
            return ""
        if self.tls is None:
            return " (a coordinator that requires mutual TLS closes plaintext connections: give ca, cert and key)"
        return (" (a coordinator closes the connection at the handshake when it does not accept the client's certificate: "
                "signed by another CA, expired or not yet valid, or not a client certificate)")

    def join(self, client: Client) -> None:
        caps = client.capabilities()
        request = pb.JoinRequest(
            name="" if self.tls is not None else client.name,  # under mTLS the certificate names it
            region=client.region,
            num_examples=client.num_examples,
            capabilities=pb.Capabilities(device=caps.device, num_accelerators=caps.num_accelerators, memory_bytes=caps.memory_bytes,
                                         codecs=list(available_codecs())),
        )
        reply: pb.JoinReply = self._call("Join", lambda: self.stub.Join(request, timeout=self.rpc_timeout))
        self.client_id, self.token, self.run_id = reply.client_id, reply.session_token, reply.run_id
        self.name = self.identity or client.name
        self.heartbeat_interval_s = reply.heartbeat_interval_s or self.heartbeat_interval_s
        self.chunk_size = reply.chunk_size or self.chunk_size

    def poll(self, wait_s: float = POLL_WAIT_S) -> pb.PollReply:
        request = pb.PollRequest(client_id=self.client_id, wait_s=wait_s)
        self.polling = True  # a long poll in flight tells the coordinator this client is alive
        try:
            return self._call("PollTask", lambda: self.stub.PollTask(request, metadata=self._session(), timeout=wait_s + self.rpc_timeout))
        finally:
            self.polling = False

    def report_failure(self, task_id: str, reason: str) -> None:
        """Tells the coordinator that this client's task ``task_id`` failed, so that the round
        records it at once (the reason is cut to what the coordinator accepts)."""
        request = pb.ReportFailureRequest(client_id=self.client_id, task_id=task_id, reason=reason[:MAX_REASON_CHARS])
        self._call("ReportFailure", lambda: self.stub.ReportFailure(request, metadata=self._session(), timeout=self.rpc_timeout))

    def leave(self, reason: str, *, timeout: float = 5.0) -> bool:
        """Tells the coordinator this client is going (one try, ``timeout`` seconds: the client
        is on its way out either way). Returns whether the coordinator heard it."""
        request = pb.LeaveRequest(client_id=self.client_id, reason=reason[:MAX_REASON_CHARS])
        try:
            self.stub.Leave(request, metadata=self._session(), timeout=timeout)
            return True
        except (grpc.RpcError, ValueError) as exc:  # ValueError: the channel closed
            log.info("could not tell the coordinator that this client leaves: %s", exc)
            return False

    def send_messages(self, task_id: str, messages: Mapping[str, bytes]) -> int:
        """Sends this client's messages of message phase ``task_id`` (recipient -> payload)."""
        request = pb.SendMessagesRequest(
            client_id=self.client_id, task_id=task_id, messages=serde.envelopes_to_pb(messages.items())
        )
        reply: pb.SendMessagesReply = self._call("SendMessages", lambda: self.stub.SendMessages(request, metadata=self._session(), timeout=self.rpc_timeout))
        return reply.bytes_accepted

    def receive_messages(self, task_id: str, *, deadline_s: float, wait_s: float = POLL_WAIT_S) -> "OrderedDict[str, bytes]":
        """The messages relayed to this client in message phase ``task_id``, by sender:
        long-polls until the phase closed (at most ``deadline_s``), then reads every page.

        Raises:
            TimeoutError: the phase did not close within ``deadline_s``.
        """
        inbox: OrderedDict[str, bytes] = OrderedDict()
        give_up = time.monotonic() + deadline_s
        while not self.stop.is_set():
            wait = max(0.0, min(wait_s, give_up - time.monotonic()))
            request = pb.ReceiveMessagesRequest(client_id=self.client_id, task_id=task_id, start=len(inbox), wait_s=wait)
            reply: pb.ReceiveMessagesReply = self._call(
                "ReceiveMessages", lambda: self.stub.ReceiveMessages(request, metadata=self._session(), timeout=wait + self.rpc_timeout)
            )
            if reply.ready:
                inbox.update((m.peer, m.payload) for m in reply.messages)
                if len(inbox) >= reply.total or not reply.messages:
                    return inbox
                continue
            if time.monotonic() >= give_up:
                raise TimeoutError(f"message phase {task_id!r} did not close within {deadline_s:.1f}s")
        raise InterruptedError("stopped while waiting for messages")

    def heartbeat(self) -> float:
        request = pb.HeartbeatRequest(client_id=self.client_id)
        reply = self.stub.Heartbeat(request, metadata=self._session(), timeout=self.rpc_timeout)
        return reply.interval_s

    def download(self, task_id: str) -> ModelState:
        """The model of ``task_id``, checked tensor by tensor (checksums, sizes)."""
        return self.download_stream(task_id)[1]

    def download_stream(self, task_id: str, *, have_version: int | None = None) -> tuple[serde.StreamInfo, ModelState]:
        """The stream of ``task_id``: its header (a difference? which versions?) and tensors."""
        request = pb.DownloadRequest(client_id=self.client_id, task_id=task_id)
        if have_version is not None:
            request.have_version = have_version

        def attempt() -> tuple[serde.StreamInfo, ModelState]:
            asm = serde.ModelAssembler()
            for frame in self._download(request, metadata=self._session(), timeout=self.transfer_timeout):
                self.bytes_down += serde.wire_size(frame)
                asm.feed(frame)
            return asm.finish()

        return self._call("DownloadModel", attempt)

    def fetch_model(self, task_id: str) -> ModelState:
        """The model to train on for a fit task, keeping the client's copy across rounds: on
        a compressed downlink the coordinator sends only the change since the version held."""
        info, received = self.download_stream(task_id, have_version=self.held_version)
        if info.delta:
            if self.held is None or info.base_version != self.held_version:
                raise InvalidUpdateError(f"downlink difference applies to version {info.base_version}, client holds {self.held_version}")
            self.held = apply_delta(self.held, received)
        else:
            self.held = received
        self.held_version = info.version or None  # 0: an uncompressed link keeps no versions
        return self.held

    def upload(
        self,
        task_id: str,
        server_round: int,
        state: ModelState,
        num_examples: int,
        metrics: dict[str, float],
        *,
        codec: str = "none",
        global_state: ModelState | None = None,
    ) -> int:
        """Sends an update, through ``codec`` (lossy codecs send the difference to
        ``global_state`` with error feedback kept across rounds). A retry asks the
        coordinator how many chunks it holds and resumes from there; one that finds the
        update already accepted counts as success."""
        uplink = self._uplinks.get(codec)
        if uplink is None:
            uplink = self._uplinks[codec] = UplinkEncoder(codec)
        if not uplink.lossless and global_state is None:
            raise ValueError(f"codec {codec!r} sends differences: pass the global model")
        encoded, delta = uplink.encode(global_state=global_state or {}, new_state=state)
        info = serde.StreamInfo(
            run_id=self.run_id,
            task_id=task_id,
            round=server_round,
            client_id=self.client_id,
            num_examples=num_examples,
            metrics=metrics,
            delta=delta,
        )
        self.upload_attempts = []
        status_request = pb.UploadStatusRequest(client_id=self.client_id, task_id=task_id)

        def attempt() -> int:
            start = 0
            if self.upload_attempts:  # a retry: continue from what the coordinator holds
                status = self.stub.UploadStatus(status_request, metadata=self._session(), timeout=self.rpc_timeout)
                if status.accepted:
                    return encoded.total_bytes  # an earlier attempt landed; its reply was lost
                start = int(status.chunks_received)
            sent = [0]
            self.upload_attempts.append(UploadAttempt(start, sent))

            def counted() -> Iterator[bytes]:
                for frame in encoded.frames(info, chunk_size=self.chunk_size, start=start):
                    sent[0] += len(frame)
                    self.bytes_up += serde.wire_size(frame)
                    yield frame

            try:
                reply = self._upload(counted(), metadata=self._session(), timeout=self.transfer_timeout)
            except grpc.RpcError as exc:
                if len(self.upload_attempts) > 1 and exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                    return encoded.total_bytes
                raise
            return int(reply.bytes_received)

        return self._call("UploadUpdate", attempt)


class _Heartbeat(threading.Thread):
    def __init__(self, conn: Connection, stop: threading.Event) -> None:
        super().__init__(name="fedgrid-heartbeat", daemon=True)
        self.conn, self.stop = conn, stop

    def run(self) -> None:
        interval = self.conn.heartbeat_interval_s
        while not self.stop.wait(interval):
            if self.conn.polling:  # the coordinator counts a client holding a poll as alive
                continue
            try:
                interval = self.conn.heartbeat() or interval
            except grpc.RpcError as exc:
                log.debug("heartbeat failed: %s", exc.code())  # the main loop's retries decide
            except ValueError:  # the channel closed as the run ended
                return


class TaskStep:
    """One fit or evaluate task, its model downloaded (by ``TaskFeed``): the caller trains or
    evaluates, then ``deliver``s the result or ``fail``s the task. What ``run`` does with every
    task and what a ``fedgrid.client.session.Session`` hands its host program.

    Attributes:
        task_id, round, deadline_s: the coordinator's task id, round and seconds for the task.
        kind: ``fedgrid.types.FIT`` or ``EVALUATE``.
        state: the global model. Lossy uplinks send the difference to it, and a compressed
            downlink applies the next round's difference to it: never change it in place.
        config: the task's scalars; ``ins``: a fit task's ``FitIns`` (``None`` for an evaluation).
    """

    def __init__(self, conn: Connection, task: pb.Task) -> None:
        self.conn = conn
        self.task_id, self.round, self.deadline_s = task.task_id, int(task.round), float(task.deadline_s)
        self.kind = EVALUATE if task.kind == pb.EVALUATE else FIT
        self._down_before, self._up_before = conn.bytes_down, conn.bytes_up
        self.started = time.monotonic()
        self.state: ModelState = conn.download(task.task_id) if self.kind == EVALUATE else conn.fetch_model(task.task_id)
        self.config: dict[str, Scalar] = serde.config_from_pb(task.config)
        self.ins: FitIns | None = serde.fit_ins_from_task(task) if self.kind == FIT else None
        #: Why the coordinator refused the latest ``deliver`` as late ("" if it did not).
        self.late = ""

    @staticmethod
    def check(update: ModelState, metrics: Mapping[str, float]) -> None:
        """Refuses a diverged fit result before it goes out (the coordinator would refuse it).

        Raises:
            InvalidUpdateError: naming the first tensor or metric that is not finite.
        """
        serde.check_finite(update)
        bad = [k for k, v in metrics.items() if not math.isfinite(v)]
        if bad:
            raise InvalidUpdateError(f"metric {bad[0]!r} is {metrics[bad[0]]}")

    def fail(self, reason: str) -> None:
        """Reports the task failed with ``reason``: the round records it at once."""
        self.conn.report_failure(self.task_id, reason)

    def deliver(self, update: ModelState, num_examples: int, metrics: Mapping[str, float]) -> TaskReport | None:
        """Uploads the result through the task's ``uplink_codec`` (error feedback kept in the
        connection). Returns what it cost, or ``None`` (``late`` says why) when the round
        closed before the update landed.

        Raises:
            RpcFailed: any other refusal, or transient failures past the retry budget.
        """
        metrics, self.late, codec = dict(metrics), "", str(self.config.get("uplink_codec", "none"))
        try:
            self.conn.upload(self.task_id, self.round, update, num_examples, metrics, codec=codec, global_state=self.state)
        except RpcFailed as exc:
            if exc.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.warning("round %d closed before the update landed: %s", self.round, exc.details)
            self.late = exc.details or "the round closed"
            return None
        loss = metrics.get("loss", metrics.get("train_loss"))
        if self.kind == FIT:
            log.info("round %d: trained on %d examples, loss %s, %.2fs", self.round, num_examples,
                     "-" if loss is None else f"{loss:.4f}", time.monotonic() - self.started)
        return TaskReport(round=self.round, kind=self.kind, num_examples=num_examples, loss=None if loss is None else float(loss),
                          bytes_up=self.conn.bytes_up - self._up_before, bytes_down=self.conn.bytes_down - self._down_before,
                          upload_retries=max(0, len(self.conn.upload_attempts) - 1))


class TaskFeed:
    """``run``'s loop without the training: joins, long-polls, joins again when the
    coordinator no longer knows the session (at most ``MAX_REJOINS`` times in a row), runs
    message phases through ``client.exchange``/``receive``, and yields every fit or evaluate
    task as a downloaded ``TaskStep``, until the run finishes or ``conn.stop`` is set.

    ``client`` is what Join says (name, region, examples) and who takes part in message
    phases. ``finished``: the coordinator said the run is over (no Leave is owed). ``lock`` is
    held across every Join: a thread that sets ``conn.stop`` and leaves under it is sure that
    no Join follows its Leave.
    """

    def __init__(self, conn: Connection, client: Client, *, poll_wait_s: float = POLL_WAIT_S,
                 on_event: Callable[[ClientEvent], None] | None = None) -> None:
        self.conn, self.client, self.poll_wait_s = conn, client, poll_wait_s
        self.on_event = on_event
        self.finished = False
        self.lock = threading.Lock()

    def emit(self, kind: str, **fields: Any) -> None:
        """Tells ``on_event`` of a change of the session (``ClientEvent``)."""
        if self.on_event is not None:
            self.on_event(ClientEvent(kind=kind, **fields))

    def join(self) -> bool:
        """Joins (again); returns ``False`` without joining once ``conn.stop`` is set."""
        with self.lock:
            if self.conn.stop.is_set():
                return False
            self.conn.join(self.client)
        self.emit("joined", client_id=self.conn.client_id, run_id=self.conn.run_id)
        return True

    def __iter__(self) -> Iterator[TaskStep]:
        conn, rejoins = self.conn, 0
        while not conn.stop.is_set():
            try:
                self.emit("polling")
                reply = conn.poll(self.poll_wait_s)
            except RpcFailed as exc:
                rejoins += 1
                if exc.code != grpc.StatusCode.UNAUTHENTICATED or rejoins > MAX_REJOINS:
                    raise
                if conn.stop.is_set():  # it left meanwhile (a Leave from another thread): nothing to rejoin
                    return
                # The coordinator no longer knows this session (it restarted without our
                # registration): join again and carry on.
                log.warning("session refused (%s): joining again", exc.details)
                run_id = conn.run_id
                if not self.join():
                    return
                if conn.run_id != run_id:  # a new run: residuals of the old model mean nothing
                    log.warning("the coordinator now runs %s (was %s): uplink state reset", conn.run_id, run_id)
                    conn.load_uplink_state_dict({})
                continue
            rejoins = 0
            kind = reply.WhichOneof("reply")
            if kind == "finished":
                self.finished = True
                return
            if kind != "task":
                continue
            self.emit("task", round=reply.task.round, task={pb.MESSAGE: "message", pb.EVALUATE: EVALUATE}.get(reply.task.kind, FIT))
            if reply.task.kind == pb.MESSAGE:
                _exchange(conn, self.client, reply.task)
                continue
            yield TaskStep(conn, reply.task)


def run(
    client: Client,
    coordinator: str,
    *,
    stop: threading.Event | None = None,
    poll_wait_s: float = POLL_WAIT_S,
    state_path: str | os.PathLike[str] | None = None,
    ca: str = "",
    cert: str = "",
    key: str = "",
    server_name: str = "",
    on_task: Callable[[TaskReport], None] | None = None,
    on_event: Callable[[ClientEvent], None] | None = None,
    **connection_options: float,
) -> RunSummary:
    """Joins ``coordinator`` and serves tasks until the run finishes or ``stop`` is set.

    Args:
        client: the application's client.
        coordinator: ``HOST:PORT``.
        stop: set it to leave the loop after the current call.
        poll_wait_s: longest long poll.
        state_path: where the client's state across rounds is saved after every fit task and
            restored from at start, when the file is this client's (same ``name``) and from
            the run the coordinator serves; any other file is logged and ignored (see
            ``load_client_state``). ``None``: kept in memory only.
        ca, cert, key: PEM files for mutual TLS (all three or none): the CA bundle that signs
            the coordinator's certificate, this client's certificate and its key. The client
            is then the identity of its certificate, which also names its state file's owner.
        server_name: the name the coordinator's certificate holds, when not the host of
            ``coordinator``.
        on_task: called with a ``TaskReport`` after each fit or evaluate task whose upload
            landed (``fedgrid client --http`` counts them as metrics).
        on_event: called with a ``ClientEvent`` at each change of the session (``fedgrid
            client --http`` serves the latest as ``/api/status``).
        connection_options: passed to ``Connection`` (``connect_timeout``, ``rpc_timeout``, ...).

    Raises:
        CoordinatorUnreachable: no answer from ``coordinator`` within ``connect_timeout``
            (a ``connection_options`` key; default ``CONNECT_TIMEOUT_S``).
        RpcFailed: a non-transient error, or transient ones past the retry budget.
        ValueError: an incomplete or unreadable set of TLS files (named), or a
            ``coordinator`` that is not ``HOST:PORT``.
    """
    stop = stop or threading.Event()
    tls = TLSFiles.from_options(ca, cert, key, what="client TLS")
    conn = Connection(coordinator, stop=stop, tls=tls, server_name=server_name, **connection_options)
    saved = load_client_state(state_path, name=conn.identity or client.name) if state_path is not None else None
    beat_stop = threading.Event()
    feed = TaskFeed(conn, client, poll_wait_s=poll_wait_s, on_event=on_event)
    rounds = 0
    heartbeat: _Heartbeat | None = None
    leaving = "stopped"
    try:
        feed.join()
        log.info("joined %s as %s (run %s)", coordinator, conn.client_id, conn.run_id)
        if saved is not None and state_path is not None:
            restore_client_state(conn, client, saved, state_path)
        heartbeat = _Heartbeat(conn, beat_stop)
        heartbeat.start()
        for step in feed:
            try:
                if step.kind == EVALUATE:
                    update, num_examples, metrics = _evaluate(client, step.state, step.config)
                else:
                    assert step.ins is not None
                    out = client.fit(step.state, step.ins)
                    update, num_examples, metrics = out.state, out.num_examples, dict(out.metrics)
                    # Diverged training (NaN or Inf) is the round's failure, not the client's end.
                    step.check(update, metrics)
            except Exception as exc:  # the application's code failed: the round hears it now, the client goes on
                log.exception("round %d: %s failed", step.round, step.kind)
                step.fail(f"{type(exc).__name__}: {exc}")
                feed.emit("error", round=step.round, detail=f"{type(exc).__name__}: {exc}")
                continue
            report = step.deliver(update, num_examples, metrics)
            _save(state_path, conn, client, step)  # a late update too: the residuals moved on all the same
            if report is None:
                feed.emit("error", round=step.round, detail="the round closed before the update landed")
                continue
            if step.kind == FIT:
                rounds += 1
            if on_task is not None:
                on_task(report)
    except BaseException as exc:  # KeyboardInterrupt and SystemExit included: the client is going
        leaving = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise
    finally:
        feed.emit("finished") if feed.finished else feed.emit("left", detail=leaving)
        if conn.client_id and not feed.finished:  # joined, and the run did not end: say so, not just go silent
            conn.leave(leaving)
        beat_stop.set()
        if heartbeat is not None:
            # A heartbeat in flight when the process exits can abort grpc's C++ core
            # ("terminate called without an active exception"): let it finish first.
            heartbeat.join(timeout=conn.rpc_timeout + 1.0)
        conn.close()
    return RunSummary(client_id=conn.client_id, rounds=rounds)


def _exchange(conn: Connection, client: Client, task: pb.Task) -> None:
    """A message phase: the client's messages go out, the ones relayed to it come back."""
    ins = serde.message_ins_from_task(task, conn.client_id)
    try:
        outbox = client.exchange(ins)
    except Exception as exc:  # the application's code failed: the phase hears it now
        log.exception("round %d: message phase %s failed", task.round, task.phase)
        conn.report_failure(task.task_id, f"{type(exc).__name__}: {exc}")
        return
    try:
        conn.send_messages(task.task_id, outbox)
        inbox = conn.receive_messages(task.task_id, deadline_s=task.deadline_s + conn.rpc_timeout)
    except RpcFailed as exc:
        if exc.code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
            raise
        log.warning("round %d: message phase %s: %s", task.round, task.phase, exc.details)
        return
    except (TimeoutError, InterruptedError) as exc:
        log.warning("round %d: message phase %s: %s", task.round, task.phase, exc)
        return
    try:
        client.receive(ins, inbox)
    except Exception:  # its next task will tell
        log.exception("round %d: receiving message phase %s failed", task.round, task.phase)


def _save(path: str | os.PathLike[str] | None, conn: Connection, client: Client, step: TaskStep) -> None:
    if path is None or step.kind == EVALUATE:
        return
    try:
        save_client_state(path, run_id=conn.run_id, server_round=step.round, client=client, conn=conn)
    except OSError as exc:  # training goes on; the next round tries again
        log.error("could not save client state to %s: %s", path, exc)


def _evaluate(client: Client, state: ModelState, config: dict) -> tuple[ModelState, int, dict[str, float]]:
    """Runs ``client.evaluate``; a client without evaluation reports zero examples."""
    try:
        out = client.evaluate(state, config)
    except NotImplementedError as exc:
        log.info("evaluation task skipped: %s", exc)
        return OrderedDict(), 0, {}
    return OrderedDict(), out.num_examples, dict(out.metrics)


class ClientHandle:
    """A client running in a background thread (see ``start``)."""

    def __init__(self, thread: threading.Thread, stop: threading.Event) -> None:
        self._thread, self._stop = thread, stop
        self.summary: RunSummary | None = None
        self.error: BaseException | None = None

    def stop(self) -> None:
        """Asks the loop to leave after its current call."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> RunSummary:
        """Waits for the loop to end; re-raises its error.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"client still running after {timeout}s")
        if self.error is not None:
            raise self.error
        assert self.summary is not None
        return self.summary

    @property
    def running(self) -> bool:
        return self._thread.is_alive()


def start(
    client: Client, coordinator: str, *, state_path: str | os.PathLike[str] | None = None, **options: Any
) -> ClientHandle:
    """Runs ``run(client, coordinator, state_path=..., **options)`` in a daemon thread of the
    host program (``options``: ``ca``, ``cert``, ``key``, ``server_name`` and ``Connection``'s)."""
    stop = threading.Event()
    handle: ClientHandle

    def target() -> None:
        try:
            handle.summary = run(client, coordinator, stop=stop, state_path=state_path, **options)
        except BaseException as exc:  # handed to join()
            handle.error = exc

    thread = threading.Thread(target=target, name=f"fedgrid-client-{client.name}", daemon=True)
    handle = ClientHandle(thread, stop)
    thread.start()
    return handle
