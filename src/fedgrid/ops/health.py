"""``fedgrid health HOST:PORT``: is a coordinator (or a region) serving? One line, exit 0 or 1.

A container health check, and a script's "is it up yet". It asks the standard gRPC health
service (``grpc.health.v1.Health/Check``) that every coordinator and region serves on its
own port, for the ``fedgrid.v1.Coordinator`` service: a coordinator reports SERVING once it
has started and NOT_SERVING while it stops (``server/serve.py``). The exit status follows
Docker's rule for health checks: 0 healthy, 1 unhealthy, for every failure (not serving,
nothing listening, a TLS handshake refused, unreadable certificate files); Docker reserves 2.

Under mutual TLS the probe is a client like any other: ``--ca`` (what signs the server's
certificate) and a client certificate and key of the same CA. The health service sits on
the TLS port but outside the coordinator's per-call identity check, so any client
certificate of the CA will do (``docker/compose.yaml`` issues one named ``probe``).

``fedgrid health`` imports no torch (the CLI imports only the module of the command it runs),
so the probe a container runs every few seconds costs a gRPC import; ``python -m
fedgrid.ops.health`` is the same command, for images without the ``fedgrid`` script on PATH.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from fedgrid.constants import HEALTH_TIMEOUT_S

__all__ = ["HealthResult", "check", "add_parser", "command", "main", "coordinator_service"]


@dataclass(frozen=True)
class HealthResult:
    """One check's answer: ``serving`` and the line that says it (the address, the status or the failure)."""

    serving: bool
    line: str


def coordinator_service() -> str:
    """The coordinator's gRPC service name, from the wire schema (``fedgrid.v1.Coordinator``)."""
    from fedgrid.proto import fedgrid_pb2

    return str(fedgrid_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name)


def check(
    address: str,
    *,
    ca: str = "",
    cert: str = "",
    key: str = "",
    server_name: str = "",
    service: str | None = None,
    timeout: float = HEALTH_TIMEOUT_S,
) -> HealthResult:
    """One ``Health/Check`` of ``service`` at ``address``, plaintext or mutual TLS.

    Args:
        address: HOST:PORT of the coordinator or region.
        ca, cert, key: mutual TLS (all three or none): the CA bundle that signs the server,
            and a client certificate and key of that CA.
        server_name: the name the server's certificate holds, when not the host of ``address``.
        service: the health service name to ask about; ``None``: the coordinator's.
        timeout: deadline of the whole check, connecting included, in seconds.
    Returns:
        The result; never raises for a peer that is down, slow or refuses the handshake.
    Raises:
        ValueError: ``ca``, ``cert``, ``key`` given partly, or a file unreadable (named).
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from fedgrid.proto.tls import TLSFiles, channel_credentials

    service = coordinator_service() if service is None else service
    tls = TLSFiles.from_options(ca, cert, key, what="fedgrid health")
    if tls is None:
        channel = grpc.insecure_channel(address)
    else:
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = grpc.secure_channel(address, channel_credentials(tls), options=options)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = " ".join(str(exc.details() if hasattr(exc, "details") else exc).split())
            if code == grpc.StatusCode.NOT_FOUND:
                return HealthResult(
                    False, f"{address}: no health status for service {service!r} (not a fedgrid coordinator?)"
                )
            what = "no answer" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "not reachable"
            return HealthResult(
                False, f"{address}: {what} within {timeout:g}s ({code.name if code else 'error'}: {details})"
            )
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    return HealthResult(serving, f"{address}: {status} ({service})")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds ``health`` to the ``fedgrid`` subcommands (``sub``: argparse's subparsers)."""
    return _flags(
        sub.add_parser(
            "health",
            help="check that a coordinator or region serves (gRPC health): exit 0 if SERVING, 1 otherwise",
        )
    )


def _flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("address", metavar="HOST:PORT", help="the coordinator's or region's address")
    parser.add_argument(
        "--ca",
        default="",
        metavar="FILE",
        help="mutual TLS: PEM CA bundle that signs the server's certificate",
    )
    parser.add_argument(
        "--cert", default="", metavar="FILE", help="mutual TLS: a client certificate of the same CA"
    )
    parser.add_argument("--key", default="", metavar="FILE", help="mutual TLS: that certificate's key")
    parser.add_argument(
        "--server-name",
        dest="server_name",
        default="",
        metavar="NAME",
        help="the name the server's certificate holds, when not the host of HOST:PORT",
    )
    parser.add_argument(
        "--service",
        default=None,
        metavar="NAME",
        help="the health service to ask about (default: fedgrid.v1.Coordinator)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=HEALTH_TIMEOUT_S,
        metavar="S",
        help=f"deadline of the check, in seconds (default {HEALTH_TIMEOUT_S:g}, FEDGRID_HEALTH_TIMEOUT_S)",
    )
    return parser


def command(args: argparse.Namespace) -> int:
    """``fedgrid health``: prints one line (stdout when serving, stderr otherwise); returns 0 or 1."""
    try:
        result = check(
            args.address,
            ca=args.ca,
            cert=args.cert,
            key=args.key,
            server_name=args.server_name,
            service=args.service,
            timeout=args.timeout,
        )
    except (
        ValueError
    ) as exc:  # TLS flags incomplete, a PEM file unreadable: unhealthy too (Docker reserves 2)
        result = HealthResult(False, " ".join(str(exc).split()))
    print(f"fedgrid health: {result.line}", file=sys.stdout if result.serving else sys.stderr, flush=True)
    return 0 if result.serving else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedgrid.ops.health``: the same flags as ``fedgrid health``."""
    return command(
        _flags(argparse.ArgumentParser(prog="fedgrid health", allow_abbrev=False)).parse_args(argv)
    )


if __name__ == "__main__":
    sys.exit(main())
