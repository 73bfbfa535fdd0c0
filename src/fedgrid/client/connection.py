"""A client's session with a coordinator (``Connection``): typed calls with deadlines, retries and mutual TLS.

Every RPC has a deadline. Transient failures (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED,
RESOURCE_EXHAUSTED) are retried with exponential backoff and jitter, logged once per backoff
step, until the give-up bound (``retry_max_elapsed`` after the first failure; before the
first answer, ``connect_timeout``); other errors surface with the server's message
(``RpcFailed``). A failure that can never pass is raised at once with its fix: an
UNAVAILABLE whose words point at the TLS handshake is diagnosed (``fedgrid.client.diagnose``:
a certificate without the name dialled, of another CA, expired; TLS on one side only), and
a session replaced by another process of the same identity (``IdentityConflict``) or a run
that is over are recognised by the coordinator's reason. ``fedgrid.client.runtime``'s loop
and the embedding session (``fedgrid.client.session``) are built on it; what its calls may
meet (errors, retried codes, channel options) is ``fedgrid.client.rpc``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import grpc
import tenacity

from fedgrid.client.api import Client
from fedgrid.client.diagnose import diagnose
from fedgrid.client.progress import ProgressReport
from fedgrid.client.rpc import (
    GRPC_OPTIONS,
    SERVICE,
    TRANSIENT,
    CoordinatorUnreachable,
    RetryWindow,
    RpcFailed,
    check_target,
    describe_error,
    failure_of,
    is_transient,
)
from fedgrid.client.uplink import UplinkEncoder
from fedgrid.client.upload import MIN_UPLOAD_CHUNK, ResumableUpload, UploadAttempt
from fedgrid.compression import available_codecs
from fedgrid.compression.feedback import apply_delta
from fedgrid.compression.spec import CodecSpec
from fedgrid.constants import (
    CONNECT_TIMEOUT_S,
    MAX_REASON_CHARS,
    POLL_WAIT_S,
    RETRY_MAX_ELAPSED_S,
    RETRY_MAX_WAIT_S,
    RPC_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
)
from fedgrid.errors import BaseModelMismatchError, InvalidUpdateError
from fedgrid.pki import identity_of
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc
from fedgrid.proto import serde
from fedgrid.proto.tls import TLSFiles, channel_credentials, session_metadata
from fedgrid.release import VERSION
from fedgrid.textsafe import escape
from fedgrid.types import ModelState

__all__ = [
    "Connection",
    "RpcFailed",
    "CoordinatorUnreachable",
    "UploadAttempt",
    "MIN_UPLOAD_CHUNK",
    "TRANSIENT",
    "GRPC_OPTIONS",
    "SERVICE",
    "check_target",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
#: Consecutive refused sessions after which the client gives up instead of joining again.
MAX_REJOINS = 3
#: gRPC's words for a failure at the TLS handshake, where ``diagnose`` can tell more.
_HANDSHAKE = re.compile(
    r"handshake|certificate|hostname|ssl|tls|socket closed|connection reset", re.IGNORECASE
)


def _identity(cert: str) -> str:
    """The identity of the certificate in file ``cert``.

    Raises:
        ValueError: the file holds no client certificate, or one without a valid identity (named).
    """
    try:
        return identity_of(Path(cert).read_bytes())
    except ValueError as exc:
        raise ValueError(f"certificate {cert}: {exc}") from None


def _open_channel(target: str, tls: TLSFiles | None, server_name: str) -> grpc.Channel:
    """A plaintext channel to ``target``, or a mutual-TLS one (``server_name``: the name the
    coordinator's certificate must hold, when it is not the host of ``target``)."""
    if tls is None:
        return grpc.insecure_channel(target, options=GRPC_OPTIONS)
    options = [*GRPC_OPTIONS, ("grpc.ssl_target_name_override", server_name)] if server_name else GRPC_OPTIONS
    return grpc.secure_channel(target, channel_credentials(tls), options=options)


def _chunk_streams(
    channel: grpc.Channel,
) -> tuple[grpc.UnaryStreamMultiCallable, grpc.StreamUnaryMultiCallable]:
    """The model download and the update upload on ``channel``: their streams carry encoded
    ``Chunk`` messages as bytes (see server/service.py), not protobuf messages."""
    download = channel.unary_stream(
        f"/{SERVICE}/DownloadModel",
        response_deserializer=None,
        request_serializer=pb.DownloadRequest.SerializeToString,
    )
    upload = channel.stream_unary(
        f"/{SERVICE}/UploadUpdate",
        request_serializer=None,
        response_deserializer=pb.UploadReply.FromString,
    )
    return download, upload


class Connection:
    """One client's session with a coordinator: typed calls with deadlines and retries.

    Args:
        target: ``HOST:PORT`` of the coordinator.
        rpc_timeout: deadline of unary calls, seconds.
        transfer_timeout: deadline of model downloads and uploads, seconds.
        retry_max_elapsed: give up on a call this many seconds after its first transient
            failure (``fedgrid client --give-up-after-s``), with ``CoordinatorLost`` saying
            what the client waited for.
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
        self.server_name = server_name
        self.channel = _open_channel(target, tls, server_name)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self._download, self._upload = _chunk_streams(self.channel)
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
        #: At most this many payload bytes per upload chunk: halved (down to
        #: ``MIN_UPLOAD_CHUNK``) when a try ran out of time without the coordinator getting one
        #: more whole chunk, as over a link too slow to carry a chunk within its idle limit.
        self.upload_chunk_cap = serde.CHUNK_SIZE
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
            InvalidUpdateError: a codec spec that does not parse.
            ConfigError: a codec that is not contractive.
            ValueError, KeyError, TypeError, AttributeError: a state that is not an encoder's.
        """
        uplinks = {}
        for codec, state in states.items():
            uplinks[codec] = UplinkEncoder(CodecSpec.read(codec))
            uplinks[codec].load_state_dict(state)
        self._uplinks = uplinks

    def _back_off(self, seconds: float) -> None:
        """The wait between two tries; a stop ends it at once, not after it."""
        self.stop.wait(seconds)

    def _call(self, method: str, fn: Callable[[], T]) -> T:
        """Calls ``fn``, retrying transient failures with jittered exponential backoff (module
        docstring); raises the failure as ``fedgrid.client.rpc.failure_of`` names it."""
        connecting = not self.reached
        budget = min(self.connect_timeout, self._retry_max_elapsed) if connecting else self._retry_max_elapsed
        window = RetryWindow(method, self.target, budget)
        problem: list[str] = []  # what diagnose found: a failure that can never pass

        def retryable(exc: BaseException) -> bool:
            found = self._diagnose(exc) if isinstance(exc, grpc.RpcError) else None
            if found is not None:
                problem.append(found)
            return found is None and is_transient(exc)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(retryable),
            wait=tenacity.wait_random_exponential(multiplier=0.2, max=self._retry_max_wait),
            stop=window | tenacity.stop_when_event_set(self.stop),
            sleep=self._back_off,
            before_sleep=window.log,
            reraise=True,
        )
        try:
            result = retrying(fn)
        except grpc.RpcError as exc:
            raise failure_of(
                exc,
                method,
                target=self.target,
                identity=self.name,
                window=window,
                connecting=connecting,
                stopped=self.stop.is_set(),
                problem=problem[-1] if problem else None,
                hint=self._hint(exc),
                tls=self.tls is not None,
            ) from exc
        self.reached = True
        return result

    def _diagnose(self, exc: grpc.RpcError) -> str | None:
        """What keeps this connection from ever working, when ``exc`` is an UNAVAILABLE that
        gRPC's words put at the TLS handshake (``fedgrid.client.diagnose``); ``None`` otherwise."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE or not _HANDSHAKE.search(exc.details() or ""):
            return None
        return diagnose(self.target, self.tls, self.server_name, timeout=min(self.rpc_timeout, 3.0))

    def _hint(self, exc: grpc.RpcError) -> str:
        """What a connection closed at the TLS handshake most likely means: the client only
        sees the socket close (the coordinator's reason stays in its own log)."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE or "Socket closed" not in (exc.details() or ""):
            return ""
        if self.tls is None:
            return " (a coordinator that requires mutual TLS closes plaintext connections: give ca, cert and key)"
        return (
            " (a coordinator closes the connection at the handshake when it does not accept the client's certificate: "
            "signed by another CA, expired or not yet valid, or not a client certificate)"
        )

    def join(self, client: Client) -> None:
        caps = client.capabilities()
        request = pb.JoinRequest(
            name="" if self.tls is not None else client.name,  # under mTLS the certificate names it
            region=client.region,
            num_examples=client.num_examples,
            capabilities=pb.Capabilities(
                device=caps.device,
                num_accelerators=caps.num_accelerators,
                memory_bytes=caps.memory_bytes,
                codecs=list(available_codecs()),
            ),
            base_hash=client.base_hash,
            lora_rank=client.lora_rank,
            fedgrid_version=VERSION,
        )
        reply: pb.JoinReply = self._call("Join", lambda: self.stub.Join(request, timeout=self.rpc_timeout))
        if reply.base_hash != client.base_hash:  # a coordinator that did not check: refuse to train
            raise BaseModelMismatchError(client.base_hash, escape(reply.base_hash, 80))
        self.client_id, self.token, self.run_id = reply.client_id, reply.session_token, reply.run_id
        self.name = self.identity or client.name
        self.heartbeat_interval_s = reply.heartbeat_interval_s or self.heartbeat_interval_s
        self.chunk_size = reply.chunk_size or self.chunk_size

    def poll(self, wait_s: float = POLL_WAIT_S) -> pb.PollReply:
        request = pb.PollRequest(client_id=self.client_id, wait_s=wait_s)
        self.polling = True  # a long poll in flight tells the coordinator this client is alive
        try:
            return self._call(
                "PollTask",
                lambda: self.stub.PollTask(
                    request, metadata=self._session(), timeout=wait_s + self.rpc_timeout
                ),
            )
        finally:
            self.polling = False

    def report_failure(self, task_id: str, reason: str) -> None:
        """Tells the coordinator that this client's task ``task_id`` failed, so that the round
        records it at once (the reason is cut to what the coordinator accepts)."""
        request = pb.ReportFailureRequest(
            client_id=self.client_id, task_id=task_id, reason=reason[:MAX_REASON_CHARS]
        )
        self._call(
            "ReportFailure",
            lambda: self.stub.ReportFailure(request, metadata=self._session(), timeout=self.rpc_timeout),
        )

    def leave(self, reason: str, *, timeout: float = 5.0) -> bool:
        """Tells the coordinator this client is going (one try, ``timeout`` seconds: the client
        is on its way out either way). Returns whether the coordinator heard it."""
        request = pb.LeaveRequest(client_id=self.client_id, reason=reason[:MAX_REASON_CHARS])
        try:
            self.stub.Leave(request, metadata=self._session(), timeout=timeout)
            return True
        except (grpc.RpcError, ValueError) as exc:  # ValueError: the channel closed
            log.info("could not tell the coordinator that this client leaves: %s", describe_error(exc))
            return False

    def send_messages(self, task_id: str, messages: Mapping[str, bytes]) -> int:
        """Sends this client's messages of message phase ``task_id`` (recipient -> payload)."""
        request = pb.SendMessagesRequest(
            client_id=self.client_id, task_id=task_id, messages=serde.envelopes_to_pb(messages.items())
        )
        reply: pb.SendMessagesReply = self._call(
            "SendMessages",
            lambda: self.stub.SendMessages(request, metadata=self._session(), timeout=self.rpc_timeout),
        )
        return reply.bytes_accepted

    def receive_messages(
        self, task_id: str, *, deadline_s: float, wait_s: float = POLL_WAIT_S
    ) -> "OrderedDict[str, bytes]":
        """The messages relayed to this client in message phase ``task_id``, by sender:
        long-polls until the phase closed (at most ``deadline_s``), then reads every page.

        Raises:
            TimeoutError: the phase did not close within ``deadline_s``.
        """
        inbox: OrderedDict[str, bytes] = OrderedDict()
        give_up = time.monotonic() + deadline_s
        while not self.stop.is_set():
            wait = max(0.0, min(wait_s, give_up - time.monotonic()))
            request = pb.ReceiveMessagesRequest(
                client_id=self.client_id, task_id=task_id, start=len(inbox), wait_s=wait
            )
            reply: pb.ReceiveMessagesReply = self._call(
                "ReceiveMessages",
                lambda: self.stub.ReceiveMessages(
                    request, metadata=self._session(), timeout=wait + self.rpc_timeout
                ),
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

    def heartbeat_future(self, progress: ProgressReport | None = None) -> "grpc.Future":
        """A heartbeat sent without waiting for its answer (``Heartbeat``), with the running task's
        ``progress`` when there is one; ``.result()`` is the reply."""
        request = pb.HeartbeatRequest(client_id=self.client_id)
        if progress is not None:
            request.progress.CopyFrom(
                pb.TaskProgress(
                    round=progress.round,
                    steps_done=progress.steps_done,
                    steps_total=progress.steps_total,
                    examples_per_s=progress.examples_per_s,
                    tokens_per_s=progress.tokens_per_s,
                    eta_s=progress.eta_s,
                )
            )
        return self.stub.Heartbeat.future(request, metadata=self._session(), timeout=self.rpc_timeout)

    def download(self, task_id: str) -> ModelState:
        """The model of ``task_id``, checked tensor by tensor (checksums, sizes)."""
        return self.download_stream(task_id)[1]

    def download_stream(
        self, task_id: str, *, have_version: int | None = None
    ) -> tuple[serde.StreamInfo, ModelState]:
        """The stream of ``task_id``: its header (a difference? which versions?) and tensors."""
        request = pb.DownloadRequest(client_id=self.client_id, task_id=task_id)
        if have_version is not None:
            request.have_version = have_version

        def attempt() -> tuple[serde.StreamInfo, ModelState]:
            asm = serde.ModelAssembler()
            messages = self._download(request, metadata=self._session(), timeout=self.transfer_timeout)
            for frame in serde.unbatched(messages):  # small frames come several a message
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
                raise InvalidUpdateError(
                    f"downlink difference applies to version {info.base_version}, client holds {self.held_version}"
                )
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
        codec: CodecSpec = CodecSpec.NONE,
        global_state: ModelState | None = None,
        task_config: Mapping[str, Any] | None = None,
        on_encoded: Callable[[], None] | None = None,
    ) -> int:
        """Sends an update, through ``codec`` (lossy codecs send the difference to
        ``global_state`` with error feedback kept across rounds). A retry asks the
        coordinator how many chunks it holds and resumes from there; one that finds the
        update already accepted counts as success. ``on_encoded`` is called once the update
        is encoded (its error feedback moved on) and before any byte of it is sent: where the
        client saves that state, so a crash cannot leave an upload that landed with a saved
        residual from before it."""
        uplink = self._uplink(codec, has_global=global_state is not None).begin(
            server_round, task_config or {}, self.name
        )
        encoded, delta = uplink.encode(global_state=global_state or {}, new_state=state)
        if on_encoded is not None:
            on_encoded()
        info = serde.StreamInfo(
            run_id=self.run_id,
            task_id=task_id,
            round=server_round,
            client_id=self.client_id,
            num_examples=num_examples,
            metrics=metrics,
            delta=delta,
        )
        return self._call("UploadUpdate", ResumableUpload(self, task_id, encoded, info))

    def _uplink(self, codec: CodecSpec, *, has_global: bool) -> UplinkEncoder:
        """The uplink encoder of ``codec``, made at its first use (its residuals persist).

        Raises:
            ValueError: a lossy codec without the global model to take the difference to.
        """
        uplink = self._uplinks.get(codec.text)
        if uplink is None:
            uplink = self._uplinks[codec.text] = UplinkEncoder(codec)
        if not uplink.lossless and not has_global:
            raise ValueError(f"codec {codec.text!r} sends differences: pass the global model")
        return uplink
