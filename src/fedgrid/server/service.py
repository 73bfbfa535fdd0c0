"""The thin gRPC servicer, on ``grpc.aio``: decode, call ``RemoteFleet``, map domain errors to
status codes in one place.

Handlers run on the server's event loop and never block it: a long poll awaits its own
wake-up (``RemoteFleet.poll_async``), so ten thousand idle polls hold no thread; CPU work
(encoding a download, checking and decoding an upload, spill writes, waiting for an upload
to settle) runs on the ``executor`` threads.

Nothing is held before it is checked. A download or upload names its session in the call's
metadata; that session (and under mutual TLS the certificate's identity) is checked first,
so a call without one is refused (UNAUTHENTICATED) before it is read or counted. The
transfer then counts against its client's and its connection's share (``server/slots.py``);
an upload's header must arrive within ``HEADER_TIMEOUT_S``, and only then does the upload
take one of the coordinator's ``MAX_TRANSFERS`` slots. Requests are decoded here, not by
gRPC: a message that is not valid protobuf is INVALID_ARGUMENT naming its type, and an
unexpected error is INTERNAL with a plain message (the traceback goes to the log), never a
Python class name.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from concurrent.futures import Executor
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, NoReturn, TypeVar

import grpc

from fedgrid.constants import (
    HEADER_TIMEOUT_S,
    MAX_TRANSFERS,
    MAX_TRANSFERS_PER_CLIENT,
    MAX_TRANSFERS_PER_CONNECTION,
    STREAM_IDLE_S,
)
from fedgrid.errors import (
    REASON_METADATA_KEY,
    AdapterRankError,
    AuthenticationError,
    BaseModelMismatchError,
    DuplicateUpdateError,
    FedgridError,
    InvalidUpdateError,
    PermissionDeniedError,
    ResourceLimitError,
    RunFinishedError,
    StaleTaskError,
    StorageError,
    VersionMismatchError,
)
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import serde
from fedgrid.server.aio import decoding, decoding_stream, wrap_behaviour
from fedgrid.server.log_budget import LogBudget
from fedgrid.server.membership import ClientRecord
from fedgrid.server.peers import CALLER, PeerCheck
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.slots import Ticket, TransferSlots
from fedgrid.server.stream_reader import StreamReader
from fedgrid.textsafe import escape
from fedgrid.types import EVALUATE, FIT, MessageIns

__all__ = ["CoordinatorServicer", "STATUS_OF", "add_to_server", "SERVICE"]

SERVICE = "fedgrid.v1.Coordinator"

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Refused calls (a revoked certificate, one that is not a client's), logged at a bounded rate.
_refusals = LogBudget(log, "calls refused")

#: One place maps each domain error to its status code (most specific first).
STATUS_OF: tuple[tuple[type[FedgridError], grpc.StatusCode], ...] = (
    (InvalidUpdateError, grpc.StatusCode.INVALID_ARGUMENT),
    (AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (DuplicateUpdateError, grpc.StatusCode.ALREADY_EXISTS),
    (StaleTaskError, grpc.StatusCode.FAILED_PRECONDITION),
    (RunFinishedError, grpc.StatusCode.FAILED_PRECONDITION),
    (BaseModelMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (AdapterRankError, grpc.StatusCode.FAILED_PRECONDITION),
    (VersionMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StorageError, grpc.StatusCode.UNAVAILABLE),  # the coordinator's disk: clients wait and retry
)


def status_of(exc: FedgridError) -> grpc.StatusCode:
    for kind, code in STATUS_OF:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def _token() -> str:
    """The session token of the call being served (its metadata, read by ``guard``)."""
    return CALLER.get().token


def _long_poll_wait(wait_s: float, context: grpc.aio.ServicerContext) -> float:
    """How long a long poll may wait: what the client asked, answered before its deadline."""
    remaining = context.time_remaining()
    return wait_s if remaining is None else min(wait_s, max(0.0, remaining - 1.0))


async def _abort(context: grpc.aio.ServicerContext, exc: FedgridError) -> NoReturn:
    # A reason (fedgrid.errors) travels as trailing metadata: the SDK tells it apart by a fixed word.
    reason = ((REASON_METADATA_KEY, exc.reason),) if exc.reason else ()
    await context.abort(status_of(exc), str(exc), trailing_metadata=reason)
    raise AssertionError("unreachable: context.abort raises")


async def _abort_with(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    await context.abort(code, details)
    raise AssertionError("unreachable: context.abort raises")


class CoordinatorServicer:
    """Implements ``fedgrid.v1.Coordinator`` over a ``RemoteFleet``.

    Args:
        fleet: the coordinator's state.
        executor: threads for CPU work and the few calls that may wait.
        max_transfers: downloads and uploads in flight at once; more are refused.
        stream_idle_s: an upload stream that sends nothing this long is given up.
        header_timeout_s: an upload stream whose header (its first message) has not arrived
            this long after it opened, or ``stream_idle_s`` if that is shorter, is given up.
        max_transfers_per_client: transfers one client (identity, or session) may hold.
        max_transfers_per_connection: transfers one connection may hold.
    """

    def __init__(
        self,
        fleet: RemoteFleet,
        executor: Executor,
        *,
        max_transfers: int = MAX_TRANSFERS,
        stream_idle_s: float = STREAM_IDLE_S,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        max_transfers_per_client: int = MAX_TRANSFERS_PER_CLIENT,
        max_transfers_per_connection: int = MAX_TRANSFERS_PER_CONNECTION,
    ) -> None:
        self.fleet = fleet
        self.executor = executor
        self.slots = TransferSlots(
            max_transfers, per_client=max_transfers_per_client, per_connection=max_transfers_per_connection
        )
        self.stream_idle_s = stream_idle_s
        # Never longer than the idle limit: a stream silent that long is given up anyway.
        self.header_timeout_s = min(header_timeout_s, stream_idle_s)

    @property
    def transfers(self) -> int:
        """Transfers holding one of the coordinator's slots now."""
        return self.slots.in_flight

    def _admit(self, context: grpc.aio.ServicerContext, record: ClientRecord) -> Ticket:
        """The transfer of a checked session, counted against its client's share (its identity
        under mutual TLS, else its session) and its connection's."""
        identity = CALLER.get().identity
        return self.slots.admit(identity or record.info.client_id, context.peer() or "")

    async def _offload(self, fn: Callable[..., T], *args: object) -> T:
        # In the call's context, so the membership sees its caller (CALLER) on the thread too.
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, contextvars.copy_context().run, fn, *args
        )

    async def _call(self, context: grpc.aio.ServicerContext, body: Callable[[], Awaitable[T]]) -> T:
        try:
            return await body()
        except FedgridError as exc:
            await _abort(context, exc)
        except TimeoutError as exc:  # an idle stream given up
            await _abort_with(context, grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except ConnectionError as exc:  # the stream broke: what arrived is kept for its resume
            await _abort_with(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        except grpc.aio.AbortError:
            raise
        except Exception:  # a bug: the log has the traceback, the client a plain message
            log.exception("internal error serving %s", escape(context.peer() or "", 128))
            await _abort_with(context, grpc.StatusCode.INTERNAL, "internal error (the coordinator logged it)")

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinReply:
        async def body() -> pb.JoinReply:
            # Another release's client would speak this wire with other rules; "" predates the field.
            if request.fedgrid_version and request.fedgrid_version != self.fleet.fedgrid_version:
                raise VersionMismatchError(escape(request.fedgrid_version, 80), self.fleet.fedgrid_version)
            if request.base_hash != self.fleet.base_hash:
                raise BaseModelMismatchError(escape(request.base_hash, 80), self.fleet.base_hash)
            self.fleet.lora_ranks.check(request.lora_rank)
            info, token = self.fleet.join(
                serde.client_info_from_join("", request), identity=CALLER.get().identity
            )
            return pb.JoinReply(
                client_id=info.client_id,
                session_token=token,
                run_id=self.fleet.run_id,
                heartbeat_interval_s=self.fleet.heartbeat_interval_s,
                chunk_size=self.fleet.chunk_size,
                base_hash=self.fleet.base_hash,
            )

        return await self._call(context, body)

    async def PollTask(self, request: pb.PollRequest, context: grpc.aio.ServicerContext) -> pb.PollReply:
        async def body() -> pb.PollReply:
            result = await self.fleet.poll_async(
                request.client_id, _token(), _long_poll_wait(request.wait_s, context)
            )
            if result.finished:
                return pb.PollReply(finished=True)
            if result.ins is None:
                return pb.PollReply(retry_after_s=result.retry_after_s)
            task = pb.Task(
                task_id=result.task_id,
                round=result.server_round,
                kind=pb.EVALUATE if result.kind == EVALUATE else pb.FIT if result.kind == FIT else pb.MESSAGE,
                config=serde.config_to_pb(result.ins.config),
                deadline_s=result.deadline_s,
            )
            if isinstance(result.ins, MessageIns):
                task.phase = result.ins.phase
                task.peers.extend(result.ins.peers)
            return pb.PollReply(task=task)

        return await self._call(context, body)

    async def DownloadModel(
        self, request: pb.DownloadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        have = request.have_version if request.HasField("have_version") else None
        try:
            # The session first: a call without one is refused before it counts anywhere.
            ticket = self._admit(context, self.fleet.authenticate(request.client_id, _token()))
        except FedgridError as exc:
            await _abort(context, exc)
        with ticket:
            try:
                ticket.take()
                # Encoding the round's model (once per round) and slicing frames are CPU work.
                frames: Iterator[bytes] = await self._offload(
                    self.fleet.download, request.client_id, _token(), request.task_id, have
                )
            except FedgridError as exc:
                await _abort(context, exc)
            try:
                # Frames are slices of the encoded model plus a few bytes of framing (a 1 MiB
                # copy each): cheaper on the loop than a hop to a thread and back per frame.
                for message in serde.batched(frames, self.fleet.chunk_size):  # small frames several a message
                    yield message
            finally:
                close = getattr(frames, "close", None)
                if close is not None:
                    close()  # counts the bytes sent, also when the client went away mid-stream

    async def UploadUpdate(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> pb.UploadReply:
        async def body() -> pb.UploadReply:
            # The session of the call's metadata first: a stream without one is refused
            # before a byte of it is read.
            with self._admit(context, self.fleet.membership.session(_token())) as ticket:
                it = request_iterator.__aiter__()
                reader = StreamReader(it, asyncio.get_running_loop(), self.stream_idle_s)
                first = await self._header(it)
                ticket.take()  # a slot for a checked session whose header arrived, no sooner
                reader.start()
                try:
                    received = await self._offload(
                        self.fleet.upload, serde.unbatched(reader.frames(first)), _token()
                    )
                finally:
                    # Cancelled: the client went away, the thread stops reading and keeps what
                    # arrived. Otherwise the stream was read to its end or refused.
                    reader.close()
                return pb.UploadReply(accepted=True, bytes_received=received)

        return await self._call(context, body)

    async def _header(self, it: AsyncIterator[bytes]) -> bytes:
        """An upload's first message, read on the loop (a stream that never sends one holds
        no thread) within ``header_timeout_s``."""
        try:
            return await asyncio.wait_for(it.__anext__(), self.header_timeout_s)
        except StopAsyncIteration:
            raise InvalidUpdateError("empty upload stream: no header") from None
        except asyncio.TimeoutError:
            raise TimeoutError(f"upload stream sent no header within {self.header_timeout_s:g}s") from None

    async def UploadStatus(
        self, request: pb.UploadStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.UploadStatusReply:
        async def body() -> pb.UploadStatusReply:
            # It may wait for a broken stream to settle on its thread: not on the loop.
            received, accepted = await self._offload(
                self.fleet.upload_status, request.client_id, _token(), request.task_id
            )
            return pb.UploadStatusReply(chunks_received=received, accepted=accepted)

        return await self._call(context, body)

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatReply:
        async def body() -> pb.HeartbeatReply:
            progress = request.progress if request.HasField("progress") else None
            return pb.HeartbeatReply(interval_s=self.fleet.heartbeat(request.client_id, _token(), progress))

        return await self._call(context, body)

    async def ReportFailure(
        self, request: pb.ReportFailureRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportFailureReply:
        async def body() -> pb.ReportFailureReply:
            self.fleet.report_failure(request.client_id, _token(), request.task_id, request.reason)
            return pb.ReportFailureReply()

        return await self._call(context, body)

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveReply:
        async def body() -> pb.LeaveReply:
            self.fleet.leave(request.client_id, _token(), request.reason)
            return pb.LeaveReply()

        return await self._call(context, body)

    async def SendMessages(
        self, request: pb.SendMessagesRequest, context: grpc.aio.ServicerContext
    ) -> pb.SendMessagesReply:
        async def body() -> pb.SendMessagesReply:
            outbox = serde.outbox_from_pb(request.messages)
            accepted = self.fleet.send_messages(request.client_id, _token(), request.task_id, outbox)
            return pb.SendMessagesReply(bytes_accepted=accepted)

        return await self._call(context, body)

    async def ReceiveMessages(
        self, request: pb.ReceiveMessagesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReceiveMessagesReply:
        async def body() -> pb.ReceiveMessagesReply:
            page = await self.fleet.receive_messages_async(
                request.client_id,
                _token(),
                request.task_id,
                request.start,
                _long_poll_wait(request.wait_s, context),
            )
            return pb.ReceiveMessagesReply(
                ready=page.ready,
                messages=serde.envelopes_to_pb(page.messages),
                total=page.total,
                retry_after_s=page.retry_after_s,
            )

        return await self._call(context, body)


def add_to_server(
    servicer: CoordinatorServicer, server: grpc.aio.Server, check: PeerCheck | None = None
) -> None:
    """Registers the service, each method behind ``guard(check)`` (default: a plaintext
    server's check, which only reads the session token). The two chunk streams move encoded
    ``Chunk`` messages as bytes (identity serializers), so model payloads are copied once on
    each side instead of passing through protobuf objects; on the wire they are ordinary
    ``Chunk`` messages."""
    check = check or PeerCheck(tls=False)

    def unary(method: Callable, request: Any, reply: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            decoding(method, request), request_deserializer=None, response_serializer=reply.SerializeToString
        )

    handlers = {
        "Join": unary(servicer.Join, pb.JoinRequest, pb.JoinReply),
        "PollTask": unary(servicer.PollTask, pb.PollRequest, pb.PollReply),
        "DownloadModel": grpc.unary_stream_rpc_method_handler(
            decoding_stream(servicer.DownloadModel, pb.DownloadRequest),
            request_deserializer=None,
            response_serializer=None,
        ),
        "UploadUpdate": grpc.stream_unary_rpc_method_handler(
            servicer.UploadUpdate,
            request_deserializer=None,
            response_serializer=pb.UploadReply.SerializeToString,
        ),
        "UploadStatus": unary(servicer.UploadStatus, pb.UploadStatusRequest, pb.UploadStatusReply),
        "Heartbeat": unary(servicer.Heartbeat, pb.HeartbeatRequest, pb.HeartbeatReply),
        "ReportFailure": unary(servicer.ReportFailure, pb.ReportFailureRequest, pb.ReportFailureReply),
        "Leave": unary(servicer.Leave, pb.LeaveRequest, pb.LeaveReply),
        "SendMessages": unary(servicer.SendMessages, pb.SendMessagesRequest, pb.SendMessagesReply),
        "ReceiveMessages": unary(
            servicer.ReceiveMessages, pb.ReceiveMessagesRequest, pb.ReceiveMessagesReply
        ),
    }
    guarded = {name: guard(check, handler) for name, handler in handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, guarded),))


async def _refuse(context: grpc.aio.ServicerContext, exc: FedgridError) -> None:
    _refusals.log(logging.INFO, "refused a call from %s: %s", escape(context.peer() or "", 128), exc)
    await context.abort(status_of(exc), str(exc))


def guard(check: PeerCheck, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` with ``check`` run first; its behaviour sees the caller in ``CALLER``."""

    def unary(behaviour: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                CALLER.set(check.caller(context))
            except FedgridError as exc:
                await _refuse(context, exc)
            return await behaviour(request, context)

        return checked

    def streaming(
        behaviour: Callable[[Any, Any], AsyncIterator[Any]],
    ) -> Callable[[Any, Any], AsyncIterator[Any]]:
        async def checked(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                CALLER.set(check.caller(context))
            except FedgridError as exc:
                await _refuse(context, exc)
            async for item in behaviour(request, context):
                yield item

        return checked

    wrapped = wrap_behaviour(handler, unary, streaming)
    if wrapped is None:
        raise TypeError("guard: bidirectional streams are not part of fedgrid.v1")
    return wrapped
