"""The thin gRPC servicer, on ``grpc.aio``: decode, call ``RemoteFleet``, map domain errors to
status codes in one place.

Handlers run on the server's event loop and never block it: a long poll awaits its own
wake-up (``RemoteFleet.poll_async``), so ten thousand idle polls hold no thread; CPU work
(encoding a download, checking and decoding an upload, spill writes, waiting for an upload
to settle) runs on the ``executor`` threads.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import queue
from concurrent.futures import Executor
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, NoReturn, TypeVar

import grpc

from fedgrid.constants import MAX_TRANSFERS, STREAM_IDLE_S
from fedgrid.errors import (
    REASON_METADATA_KEY,
    AuthenticationError,
    DuplicateUpdateError,
    FedgridError,
    InvalidUpdateError,
    PermissionDeniedError,
    ResourceLimitError,
    RunFinishedError,
    StaleTaskError,
)
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import serde
from fedgrid.server.aio import wrap_behaviour
from fedgrid.server.peers import CALLER, PeerCheck
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.textsafe import escape
from fedgrid.types import EVALUATE, FIT, MessageIns

__all__ = ["CoordinatorServicer", "STATUS_OF", "add_to_server", "SERVICE"]

SERVICE = "fedgrid.v1.Coordinator"

log = logging.getLogger(__name__)

T = TypeVar("T")

#: One place maps each domain error to its status code (most specific first).
STATUS_OF: tuple[tuple[type[FedgridError], grpc.StatusCode], ...] = (
    (InvalidUpdateError, grpc.StatusCode.INVALID_ARGUMENT),
    (AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (DuplicateUpdateError, grpc.StatusCode.ALREADY_EXISTS),
    (StaleTaskError, grpc.StatusCode.FAILED_PRECONDITION),
    (RunFinishedError, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED),
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


_END = object()
_CANCELLED = object()

#: Upload frames the event loop reads ahead of the thread checking them (per stream).
READ_AHEAD_FRAMES = 4


class _StreamReader:
    """Hands an upload's frames, read on the event loop, to the executor thread checking them.

    A task on the loop reads up to ``READ_AHEAD_FRAMES`` frames ahead into a queue the thread
    takes them from; it waits while the queue is full (backpressure), and the two threads
    wake each other only at those edges, not once per frame (a round trip through the loop
    per 1 MiB frame cost more than checking the frame). A stream that sends nothing for
    ``STREAM_IDLE_S`` ends with ``TimeoutError``, and ``close`` (the RPC was cancelled) ends it
    at once with ``ConnectionError``: either way the fleet keeps what was verified so that
    the client resumes from there.
    """

    def __init__(self, it: AsyncIterator[bytes], loop: asyncio.AbstractEventLoop, idle_s: float) -> None:
        self.it, self.loop, self.idle_s = it, loop, idle_s
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._room = asyncio.Event()  # set while the queue has room; changed on the loop only
        self._room.set()
        self._closed = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts reading ahead (on the loop)."""
        self._task = self.loop.create_task(self._pump())

    def close(self) -> None:
        """Stops reading; the thread checks the frames already received, then raises
        ``ConnectionError`` (so the client resumes after every frame that arrived whole)."""
        self._closed = True
        self._queue.put(_CANCELLED)  # after the queued frames; wakes a thread waiting for one
        if self._task is not None:
            self._task.cancel()

    async def _pump(self) -> None:
        try:
            while not self._closed:
                if self._queue.qsize() >= READ_AHEAD_FRAMES:
                    self._room.clear()
                    if self._queue.qsize() >= READ_AHEAD_FRAMES:  # the thread takes, then looks at _room
                        await self._room.wait()
                    continue
                self._queue.put(await self.it.__anext__())  # type: ignore[attr-defined]
        except StopAsyncIteration:
            self._queue.put(_END)
        except Exception as exc:  # the stream broke: the thread raises it
            self._queue.put(ConnectionError(f"the upload stream broke: {exc!r}"))

    def frames(self, first: bytes) -> Iterator[bytes]:
        yield first
        while True:
            try:
                item = self._queue.get(timeout=self.idle_s)
            except queue.Empty:
                raise TimeoutError(f"upload stream idle for {self.idle_s:g}s") from None
            if item is _CANCELLED:
                raise ConnectionError("the upload stream was cancelled")
            if not self._room.is_set():
                self.loop.call_soon_threadsafe(self._room.set)
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]


class CoordinatorServicer:
    """Implements ``fedgrid.v1.Coordinator`` over a ``RemoteFleet``.

    Args:
        fleet: the coordinator's state.
        executor: threads for CPU work and the few calls that may wait.
        max_transfers: downloads and uploads in flight at once; more are refused.
        stream_idle_s: an upload stream that sends nothing this long is given up.
    """

    def __init__(
        self,
        fleet: RemoteFleet,
        executor: Executor,
        *,
        max_transfers: int = MAX_TRANSFERS,
        stream_idle_s: float = STREAM_IDLE_S,
    ) -> None:
        self.fleet = fleet
        self.executor = executor
        self.max_transfers = max_transfers
        self.stream_idle_s = stream_idle_s
        self.transfers = 0  # in flight; changed on the event loop only

    def _start_transfer(self) -> None:
        if self.transfers >= self.max_transfers:
            raise ResourceLimitError(
                f"coordinator busy: {self.transfers} transfers in flight (limit {self.max_transfers}); retry later"
            )
        self.transfers += 1

    async def _offload(self, fn: Callable[..., T], *args: object) -> T:
        # In the call's context, so the registry sees its caller (CALLER) on the thread too.
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, contextvars.copy_context().run, fn, *args
        )

    async def _call(self, context: grpc.aio.ServicerContext, body: Callable[[], Awaitable[T]]) -> T:
        try:
            return await body()
        except FedgridError as exc:
            await _abort(context, exc)
        except TimeoutError as exc:  # an idle stream given up
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
            raise AssertionError("unreachable: context.abort raises") from exc

    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinReply:
        async def body() -> pb.JoinReply:
            info, token = self.fleet.join(
                serde.client_info_from_join("", request), identity=CALLER.get().identity
            )
            return pb.JoinReply(
                client_id=info.client_id,
                session_token=token,
                run_id=self.fleet.run_id,
                heartbeat_interval_s=self.fleet.heartbeat_interval_s,
                chunk_size=self.fleet.chunk_size,
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
            self._start_transfer()
        except FedgridError as exc:
            await _abort(context, exc)
        try:
            try:
                # Encoding the round's model (once per round) and slicing frames are CPU work.
                frames: Iterator[bytes] = await self._offload(
                    self.fleet.download, request.client_id, _token(), request.task_id, have
                )
            except FedgridError as exc:
                await _abort(context, exc)
            try:
                # Frames are slices of the encoded model plus a few bytes of framing (a 1 MiB
                # copy each): cheaper on the loop than a hop to a thread and back per frame.
                for frame in frames:
                    yield frame
            finally:
                close = getattr(frames, "close", None)
                if close is not None:
                    close()  # counts the bytes sent, also when the client went away mid-stream
        finally:
            self.transfers -= 1

    async def UploadUpdate(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> pb.UploadReply:
        it = request_iterator.__aiter__()
        reader = _StreamReader(it, asyncio.get_running_loop(), self.stream_idle_s)

        async def body() -> pb.UploadReply:
            self._start_transfer()
            try:
                # The header arrives on the loop: a stream that never sends one holds no thread.
                try:
                    first = await asyncio.wait_for(it.__anext__(), self.stream_idle_s)  # type: ignore[arg-type]
                except StopAsyncIteration:
                    raise InvalidUpdateError("empty upload stream: no header") from None
                except asyncio.TimeoutError:
                    raise TimeoutError(
                        f"upload stream sent no header within {self.stream_idle_s:g}s"
                    ) from None
                reader.start()
                try:
                    received = await self._offload(self.fleet.upload, reader.frames(first), _token())
                finally:
                    # Cancelled: the client went away, the thread stops reading and keeps what
                    # arrived. Otherwise the stream was read to its end or refused.
                    reader.close()
                return pb.UploadReply(accepted=True, bytes_received=received)
            finally:
                self.transfers -= 1

        return await self._call(context, body)

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
            return pb.HeartbeatReply(interval_s=self.fleet.heartbeat(request.client_id, _token()))

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
            method, request_deserializer=request.FromString, response_serializer=reply.SerializeToString
        )

    handlers = {
        "Join": unary(servicer.Join, pb.JoinRequest, pb.JoinReply),
        "PollTask": unary(servicer.PollTask, pb.PollRequest, pb.PollReply),
        "DownloadModel": grpc.unary_stream_rpc_method_handler(
            servicer.DownloadModel,
            request_deserializer=pb.DownloadRequest.FromString,
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
    log.info("refused a call from %s: %s", escape(context.peer() or "", 128), exc)
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
