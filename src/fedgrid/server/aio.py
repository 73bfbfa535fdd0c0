"""The event-loop thread the coordinator's gRPC servers (``grpc.aio``) run on.

A ``grpc.aio`` server lives on an asyncio loop; the coordinator's callers (the round engine,
``_serve``, tests) are plain threads. ``LoopThread`` runs one loop forever in a daemon thread
and lets those threads run coroutines on it with a deadline, so the coordinator service
(``server/serve.py``) and the enrollment service (``server/enrollment.py``) share the plumbing.

Both decode their requests themselves (``decoding``; gRPC's deserializer answers bytes that
are not protobuf with UNKNOWN and the Python exception class): such a request is
INVALID_ARGUMENT, ``malformed fedgrid.v1.JoinRequest: the request is not a valid protobuf
message``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Coroutine, TypeVar

import grpc
from google.protobuf.message import DecodeError

__all__ = ["LoopThread", "advertised_address", "wrap_behaviour", "decoding", "decoding_stream"]

T = TypeVar("T")


class LoopThread:
    """An asyncio event loop running in a daemon thread of its own, started at construction.

    Args:
        name: the thread's name (it shows in stack dumps and ``py-spy``).
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the loop still runs (``close`` not called yet)."""
        return self._thread.is_alive()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Runs ``coro`` on the loop and waits for its result.

        Raises:
            TimeoutError: it took longer than ``timeout`` seconds (it goes on running).
            Exception: whatever ``coro`` raised.
        """
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the loop and waits up to ``timeout`` seconds for its thread to end."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout)


def advertised_address(listen: str, port: int) -> str:
    """The ``HOST:PORT`` a local script dials for a server bound to ``listen`` on ``port``: a
    wildcard host (``0.0.0.0``, ``[::]``) becomes ``127.0.0.1``."""
    host = listen.rpartition(":")[0]
    return f"{'127.0.0.1' if host in ('0.0.0.0', '[::]') else host}:{port}"


def wrap_behaviour(
    handler: grpc.RpcMethodHandler, unary: Callable[[Any], Any], streaming: Callable[[Any], Any]
) -> grpc.RpcMethodHandler | None:
    """``handler`` with its behaviour wrapped: by ``unary`` for a call that returns one reply
    (unary-unary, stream-unary: an awaitable), by ``streaming`` for one that yields replies
    (unary-stream: an async generator). ``None`` for a bidirectional stream, which
    ``fedgrid.v1`` does not have: the caller decides."""
    if handler.unary_unary is not None:
        return handler._replace(unary_unary=unary(handler.unary_unary))  # type: ignore[attr-defined]
    if handler.stream_unary is not None:
        return handler._replace(stream_unary=unary(handler.stream_unary))  # type: ignore[attr-defined]
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=streaming(handler.unary_stream))  # type: ignore[attr-defined]
    return None


async def _decode(message_type: Any, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
    """``raw`` as a ``message_type`` request; a call whose bytes are not one ends INVALID_ARGUMENT."""
    try:
        return message_type.FromString(raw)
    except DecodeError:
        name = message_type.DESCRIPTOR.full_name
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"malformed {name}: the request is not a valid protobuf message"
        )
        raise AssertionError("unreachable: context.abort raises") from None


def decoding(method: Callable[[Any, Any], Any], message_type: Any) -> Callable[[Any, Any], Any]:
    """A unary ``method`` (an async one) that takes its request as bytes, decoded first: register
    it with ``request_deserializer=None``."""

    async def decoded(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await method(await _decode(message_type, raw, context), context)

    return decoded


def decoding_stream(method: Callable[[Any, Any], Any], message_type: Any) -> Callable[[Any, Any], Any]:
    """``decoding`` for a method that streams its replies (an async generator)."""

    async def decoded(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        async for item in method(await _decode(message_type, raw, context), context):
            yield item

    return decoded
