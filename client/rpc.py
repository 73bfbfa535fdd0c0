"""What a client's calls to its coordinator may meet: the errors they raise (``RpcFailed``,
``CoordinatorUnreachable``), the status codes retried (``TRANSIENT``), the channel options
and the check of a coordinator's address. ``fedgrid.client.connection`` makes the calls.
"""

from __future__ import annotations

import grpc

from fedgrid.constants import MAX_MESSAGE_BYTES
from fedgrid.errors import FedgridError

__all__ = ["RpcFailed", "CoordinatorUnreachable", "TRANSIENT", "GRPC_OPTIONS", "SERVICE", "check_target"]

SERVICE = "fedgrid.v1.Coordinator"
#: Retried with backoff. CANCELLED too: a coordinator shutting down cancels calls in flight
#: (a call this client cancels itself ends the loop through ``stop`` instead).
#: RESOURCE_EXHAUSTED too: the coordinator is at a limit (transfers in flight) for now.
TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Each client its own connection, also when a program embeds many: channels with the
    # same target would otherwise share one, and its stream limit, and fail together.
    ("grpc.use_local_subchannel_pool", 1),
]


class RpcFailed(FedgridError):
    """An RPC failed with a non-transient status, or retries ran out. ``code`` is the status."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method} failed: {code.name}: {details}")
        self.code = code
        self.details = details


class CoordinatorUnreachable(RpcFailed):
    """The client never reached its coordinator within the connect deadline."""

    def __init__(
        self, target: str, deadline_s: float, code: grpc.StatusCode, details: str, tls: bool
    ) -> None:
        RpcFailed.__init__(self, "Join", code, details)
        check_tls = (
            "the coordinator accepts this client's certificate (--ca, --cert, --key)"
            if tls
            else "the coordinator serves plaintext (one with mutual TLS needs --ca, --cert and --key)"
        )
        self.args = (
            f"could not reach the coordinator at {target} within {deadline_s:g}s ({code.name}: {_one_line(details)}): "
            f"check that it is running, that {target} is its address and port (RUN_DIR/address), and that {check_tls}",
        )


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
        raise ValueError(
            f"{what} address {target!r} has port {port!r}: expected HOST:PORT with a port in 1..65535"
        )
    return target


def _one_line(text: str) -> str:
    """gRPC's details can span lines (its debug string): one line for a log or an error."""
    return " ".join(text.split())


def _describe(exc: BaseException | None) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {_one_line(exc.details() or '')}"
    return _one_line(f"{type(exc).__name__}: {exc}") if exc is not None else ""


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() in TRANSIENT
