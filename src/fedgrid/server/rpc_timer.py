"""The coordinator's RPC timer: a ``grpc.aio`` server interceptor that times each call of the
coordinator's service, long polls and streams included, into the monitor's
``fedgrid_rpc_duration_seconds`` histogram, labelled by method (a fixed set, ``other`` for any
other) and status code (``OK`` when the call returned and set none).
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

import grpc

from fedgrid.server.aio import wrap_behaviour

__all__ = ["RpcTimer"]

#: The gRPC methods timed by name; any other is ``other``.
_METHODS = frozenset(
    {
        "Join",
        "PollTask",
        "DownloadModel",
        "UploadUpdate",
        "UploadStatus",
        "Heartbeat",
        "ReportFailure",
        "Leave",
        "SendMessages",
        "ReceiveMessages",
        "Check",
        "Watch",
    }
)


class RpcTimer(grpc.aio.ServerInterceptor):
    """Times each call of the coordinator's service into ``histogram`` (labels method, code)."""

    def __init__(self, histogram: Any) -> None:
        self.histogram = histogram

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rpartition("/")[2]
        method = method if method in _METHODS else "other"
        observe = self.histogram

        def done(start: float, context: Any, error: BaseException | None) -> None:
            code = _code_name(context, error)
            observe.labels(method=method, code=code).observe(time.monotonic() - start)

        def unary(behaviour: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            async def timed(request: Any, context: Any) -> Any:
                start, error = time.monotonic(), None
                try:
                    return await behaviour(request, context)
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    done(start, context, error)

            return timed

        def streaming(behaviour: Callable[..., Any]) -> Callable[..., Any]:
            async def timed(request: Any, context: Any) -> Any:
                start, error = time.monotonic(), None
                try:
                    async for item in behaviour(request, context):
                        yield item
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    done(start, context, error)

            return timed

        return wrap_behaviour(handler, unary, streaming) or handler


def _code_name(context: Any, error: BaseException | None) -> str:
    """The call's status code name (``OK`` when it returned and set none)."""
    code = None
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - older grpc.aio contexts have no code()
        code = None
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        for c in grpc.StatusCode:
            if c.value[0] == code:
                return c.name
    return "OK" if error is None else "UNKNOWN"
