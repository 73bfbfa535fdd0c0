"""What a client's calls to its coordinator may meet: the errors they raise (``RpcFailed``,
``CoordinatorUnreachable``, ``MisconfiguredConnection``, ``CoordinatorLost``,
``IdentityConflict``), the status codes retried (``TRANSIENT``), the channel options and the
check of a coordinator's address. ``fedgrid.client.connection`` makes the calls.

Errors are permanent or transient. Permanent ones are raised at once, with their fix: a
malformed address (``check_target``), a TLS handshake that can never succeed
(``fedgrid.client.diagnose``), a run that is over, a session that another process of the
same identity replaced. Transient ones (``TRANSIENT``: a coordinator down, restarting or
busy) are retried until the give-up bound.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time

import grpc
import tenacity

from fedgrid.constants import MAX_MESSAGE_BYTES
from fedgrid.errors import REASON_METADATA_KEY, RUN_FINISHED, SESSION_REPLACED, FedgridError

__all__ = [
    "RpcFailed",
    "CoordinatorUnreachable",
    "MisconfiguredConnection",
    "CoordinatorLost",
    "IdentityConflict",
    "TRANSIENT",
    "is_transient",
    "GRPC_OPTIONS",
    "SERVICE",
    "check_target",
    "describe_error",
    "reason_of",
    "RetryWindow",
    "WAITING_FOR",
]

# The connection's logger: retry lines have always come from it.
log = logging.getLogger("fedgrid.client.connection")

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
    """An RPC failed with a non-transient status, or retries ran out. ``code`` is the status;
    ``reason`` the coordinator's word for the refusal (``fedgrid.errors``; "" for none)."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str, reason: str = "") -> None:
        super().__init__(f"{method} failed: {code.name}: {details}")
        self.code = code
        self.details = details
        self.reason = reason


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


class MisconfiguredConnection(CoordinatorUnreachable):
    """The client can never reach its coordinator as configured (a certificate whose names do
    not include the address dialled, one of another CA or expired, plaintext against mutual
    TLS): raised at the first failure, not after the connect deadline, naming the fix."""

    def __init__(self, target: str, code: grpc.StatusCode, details: str, problem: str) -> None:
        RpcFailed.__init__(self, "Join", code, details)
        self.problem = problem
        self.args = (f"cannot connect to the coordinator at {target}: {problem}",)


class CoordinatorLost(RpcFailed):
    """A coordinator the client had reached stopped answering for longer than the give-up
    bound (``fedgrid client --give-up-after-s``): the message says what the client waited for."""

    def __init__(
        self, method: str, target: str, waited_s: float, code: grpc.StatusCode, details: str, waiting_for: str
    ) -> None:
        RpcFailed.__init__(self, method, code, details)
        self.waited_s = waited_s
        self.args = (
            f"gave up after {waited_s:.0f}s without an answer from the coordinator at {target} "
            f"(--give-up-after-s), waiting for {waiting_for} ({method}: {code.name}: {_one_line(details)}): "
            "a coordinator stopped without --state-dir does not come back; raise --give-up-after-s "
            "to wait longer for one that restarts",
        )


class IdentityConflict(RpcFailed):
    """The coordinator replaced this client's session with a newer one of the same identity while
    this process still ran: two processes hold one identity. The SDK stops instead of joining
    again (which would replace the other process in turn, for ever). ``identity``: the name."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str, identity: str) -> None:
        RpcFailed.__init__(self, method, code, details, reason=SESSION_REPLACED)
        self.identity = identity
        self.args = (
            f"identity {identity!r} is taken: another process joined the coordinator as {identity!r} "
            "and replaced this client's session. Two processes with the same --partition or the same "
            "certificate? Give each client its own --partition I/N (or certificate), or stop the other one",
        )


#: A URL's scheme, or one of gRPC's name resolvers (``dns:``, ``unix:``): not a HOST.
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://|(dns|unix|unix-abstract|ipv4|ipv6|vsock|xds):(?!\d+$))")
#: A DNS name: dot-separated labels of letters, digits, hyphens and underscores.
_HOSTNAME = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(\.(?!-)[A-Za-z0-9_-]{1,63})*\.?$")


def check_target(target: str, *, what: str = "coordinator") -> str:
    """``target`` if it is ``HOST:PORT`` with a port in 1..65535 (``[::1]:PORT`` for IPv6), the
    host a DNS name or an IP address.

    gRPC reads a bare host as port 443 and other odd forms as name-resolver schemes
    (``http://127.0.0.1:50051`` is a name to look up): a typo would dial something else and
    retry there for as long as the deadline allows.

    Raises:
        ValueError: not of that form (the message names ``what`` and the expected form).
    """
    example = "expected HOST:PORT, e.g. 127.0.0.1:50051"
    scheme = _SCHEME.match(target)
    if scheme:
        raise ValueError(
            f"{what} address {target!r} starts with a scheme {scheme.group(0)!r}: {example} (no http://, dns: or unix:)"
        )
    host, sep, port = target.rpartition(":")
    if not sep or not host or host.endswith(":") and not host.startswith("["):
        raise ValueError(f"{what} address {target!r} has no port: {example}")
    if not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(
            f"{what} address {target!r} has port {port!r}: expected HOST:PORT with a port in 1..65535"
        )
    if not _valid_host(host):
        raise ValueError(
            f"{what} address {target!r} has host {host!r}, not a host name or IP address: {example}"
        )
    return target


def _valid_host(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.ip_address(host[1:-1]).version == 6
        except ValueError:
            return False
    return bool(_HOSTNAME.match(host))


def reason_of(exc: grpc.RpcError) -> str:
    """The coordinator's word for a refusal (``fedgrid.errors.REASON_METADATA_KEY``), "" if none."""
    trailing = getattr(exc, "trailing_metadata", None)
    try:
        pairs = trailing() if callable(trailing) else None
    except Exception:  # noqa: BLE001 - a call that never started has none
        return ""
    for key, value in pairs or ():
        if key == REASON_METADATA_KEY:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return ""


def _one_line(text: str) -> str:
    """gRPC's details can span lines (its debug string): one line for a log or an error."""
    return " ".join(text.split())


def describe_error(exc: BaseException | None) -> str:
    """``exc`` in one line: a gRPC error as ``CODE: details`` (not its multi-line repr)."""
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {_one_line(exc.details() or '')}"
    return _one_line(f"{type(exc).__name__}: {exc}") if exc is not None else ""


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a gRPC error whose code is ``TRANSIENT`` (worth a retry)."""
    return isinstance(exc, grpc.RpcError) and exc.code() in TRANSIENT


#: What a client waits for in each call: the words of ``CoordinatorLost``.
WAITING_FOR = {
    "Join": "its join to be accepted",
    "PollTask": "its next task",
    "DownloadModel": "the task's model",
    "UploadUpdate": "its update to be taken",
    "ReportFailure": "its failure report to be heard",
    "SendMessages": "its messages to be taken",
    "ReceiveMessages": "the messages of its message phase",
}


class RetryWindow(tenacity.stop.stop_base):
    """One call's run of transient failures, as ``tenacity``'s stop condition and its
    ``before_sleep`` hook: it stops ``budget`` seconds after the first failure (the time a
    long poll spent waiting before it failed does not count), and logs the first failure,
    then once per backoff step: each time the time waited doubles. A coordinator down for two
    minutes costs eight lines, not one per try."""

    def __init__(self, method: str, target: str, budget: float) -> None:
        self.method, self.target, self.budget = method, target, budget
        self.since: float | None = None
        self.tries = 0
        self._next_line = 0.0

    @property
    def waited(self) -> float:
        """Seconds since the first failure (0 before one)."""
        return 0.0 if self.since is None else time.monotonic() - self.since

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        if self.since is None:
            self.since = time.monotonic()
        return self.waited >= self.budget

    def log(self, retry_state: tenacity.RetryCallState) -> None:
        self.tries += 1
        outcome = retry_state.outcome
        why = describe_error(outcome.exception() if outcome is not None else None)
        if self.tries == 1:
            log.info("%s on %s: %s; retrying for up to %.0fs", self.method, self.target, why, self.budget)
            self._next_line = 1.0
        elif self.waited >= self._next_line:
            log.info(
                "%s on %s: still failing after %.0fs (%d tries): %s",
                self.method,
                self.target,
                self.waited,
                self.tries,
                why,
            )
            self._next_line = 2 * self.waited


def failure_of(
    exc: grpc.RpcError,
    method: str,
    *,
    target: str,
    identity: str,
    window: RetryWindow,
    connecting: bool,
    stopped: bool,
    problem: str | None,
    hint: str,
    tls: bool,
) -> RpcFailed:
    """The error a call that failed with ``exc`` raises: permanent ones with their fix
    (``problem``: ``fedgrid.client.diagnose``'s verdict; a session replaced by another process
    of ``identity``; a run that is over), transient ones past the retry budget as
    ``CoordinatorUnreachable`` (before the first answer) or ``CoordinatorLost`` (after one)."""
    code, details, reason = exc.code(), exc.details() or "", reason_of(exc)
    if reason == SESSION_REPLACED:
        return IdentityConflict(method, code, _one_line(details), identity)
    if reason == RUN_FINISHED:
        words = f"{_one_line(details)}: the coordinator at {target} finished its run; start a new run to train again"
        return RpcFailed(method, code, words, reason)
    if problem is not None:
        return MisconfiguredConnection(target, code, details, problem)
    if is_transient(exc) and not stopped:
        if connecting:
            return CoordinatorUnreachable(target, window.budget, code, details + hint, tls)
    if is_transient(exc) and not stopped and code != grpc.StatusCode.RESOURCE_EXHAUSTED:  # busy is an answer
        waiting_for = WAITING_FOR.get(method, f"an answer to {method}")
        return CoordinatorLost(method, target, window.waited, code, details, waiting_for)
    return RpcFailed(method, code, _one_line(details + hint))
