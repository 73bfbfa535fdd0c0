"""The client's wiring, the twin of ``server/serve.py``: ``fedgrid client``'s process from a
client factory to a finished run.

``serve_client`` enrolls (rank 0, once), builds the client (one process, or a
``ParallelClient`` over local ranks), reports its capabilities, serves its metrics when
asked, and runs ``fedgrid.client.runtime.run_client`` until the federation finishes or a signal
stops it. The command line (``fedgrid.cli.client``) parses flags and picks the factory: the
built-in one lives with the datasets, which this layer never imports.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

from fedgrid.client import runtime
from fedgrid.config import Config
from fedgrid.errors import ConfigError, FedgridError
from fedgrid.interrupts import GracefulStop
from fedgrid.proto.tls import is_loopback

__all__ = [
    "ENROLL_TOKEN_ENV",
    "MAX_TOKEN_FILE_BYTES",
    "check_addresses",
    "enroll_client",
    "enroll_token",
    "parallel_spec",
    "parse_partition",
    "serve_client",
]

log = logging.getLogger(__name__)

#: A client factory: ``factory(partition, num_partitions, seed, **options) -> Client``.
ClientFactory = Callable[..., Any]


def check_addresses(args: argparse.Namespace) -> None:
    """``--coordinator`` and ``--enroll-address`` are HOST:PORT targets, the connect and
    give-up bounds positive seconds, and a coordinator off loopback is reached over TLS unless
    ``--insecure`` says otherwise.

    Raises:
        ConfigError: a malformed one (the key named); plaintext to a non-loopback coordinator
            without ``--insecure``.
    """
    try:
        runtime.check_target(args.coordinator)
    except ValueError as exc:
        raise ConfigError("coordinator", str(exc)) from None
    host = args.coordinator.rpartition(":")[0]
    if not getattr(args, "ca", None) and not getattr(args, "insecure", False) and not is_loopback(host):
        # The coordinator's rule, mirrored: plaintext off loopback only when asked for.
        raise ConfigError(
            "coordinator",
            f"{args.coordinator} is not a loopback address, and plaintext there lets anyone on the path "
            "read and change the model: give --ca, --cert and --key (mutual TLS; see `fedgrid certs`), "
            "or --insecure to connect in plaintext anyway",
        )
    for key in ("connect_timeout_s", "give_up_after_s"):
        value = getattr(args, key, None)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ConfigError(key, f"must be a positive number of seconds, got {value}")
    if args.enroll_address:
        try:
            runtime.check_target(args.enroll_address, what="enrollment")
        except ValueError as exc:
            raise ConfigError("enroll_address", str(exc)) from None


def parse_partition(text: str) -> tuple[int, int]:
    """``--partition I/N`` as ``(I, N)``.

    Raises:
        ConfigError: not ``I/N`` with ``0 <= I < N``.
    """
    try:
        index_s, total_s = text.split("/")
        index, total = int(index_s), int(total_s)
    except ValueError:
        raise ConfigError("partition", f"expected I/N, got {text!r}") from None
    if not 0 <= index < total:
        raise ConfigError("partition", f"index {index} is outside 0..{total - 1}")
    return index, total


def parallel_spec(config: Config) -> Any:
    """The client's ``ParallelSpec`` from its keys; under torchrun, its world size is the ranks'.

    Raises:
        ConfigError: a bad ``parallel``, ``comm_hook`` or rank count (the key named).
    """
    from fedgrid.client.parallel import ParallelSpec, torchrun_rank

    ranks = torchrun_rank()
    nproc = ranks[2] if ranks is not None else config.nproc_per_node
    try:
        return ParallelSpec.parse(
            nproc,
            config.parallel,
            comm_hook=config.comm_hook,
            collective_timeout_s=config.collective_timeout_s,
        )
    except ValueError as exc:
        key = next(
            (k for k in ("comm_hook", "nproc_per_node", "collective_timeout_s") if str(exc).startswith(k)),
            "parallel",
        )
        raise ConfigError(key, str(exc)) from None


def _build(factory: ClientFactory, args: argparse.Namespace, config: Config, options: dict[str, Any]) -> Any:
    """The client: the factory's, or a ``ParallelClient`` whose ranks each run the factory."""
    import torch

    from fedgrid.client.parallel import torchrun_rank

    index, total = parse_partition(args.partition)
    spec = parallel_spec(config)
    client: Any
    if spec.nproc > 1 and torchrun_rank() is None:
        from fedgrid.client.parallel import ParallelClient

        client = ParallelClient(
            factory, (index, total, args.seed), options, spec=spec, threads=config.threads
        )
    else:
        client = factory(index, total, args.seed, **options)
    print(
        f"fedgrid client {index}/{total}: {torch.get_num_threads()} threads, torch {torch.__version__}"
        + (f", {spec.nproc} ranks ({config.parallel})" if spec.nproc > 1 else ""),
        flush=True,
    )
    if args.region:
        client.region = args.region
    from fedgrid.capabilities import describe
    from fedgrid.client.capabilities import override_from

    client.capability_override = override_from(config)
    try:
        reported = client.capabilities()
    except ValueError as exc:  # an --app's own capabilities(): before run(), whose ValueErrors are TLS files
        raise ConfigError("app", f"the client's capabilities: {exc}") from None
    print(
        f"fedgrid client {index}/{total}: reports "
        f"{describe(reported.device, reported.num_accelerators, reported.memory_bytes)} at join",
        flush=True,
    )
    return client


def _monitor(args: argparse.Namespace, client: Any) -> tuple[Any, Any, Any]:
    """``--http``: the client's /metrics and /api/status (rank 0 only); ``(on_task, on_event, server)``."""
    from fedgrid.client.parallel import torchrun_rank

    rank = torchrun_rank()
    if not (args.http or args.http_token_file) or (rank is not None and rank[0] != 0):
        return None, None, None
    from fedgrid.client.monitor import serve_client_metrics

    if not args.http:
        raise ConfigError("http_token_file", "goes with --http (the address of the client's metrics)")
    monitor, http = serve_client_metrics(
        args.http, token_file=args.http_token_file, name=client.name, coordinator=args.coordinator
    )
    index, total = parse_partition(args.partition)
    print(
        f"fedgrid client {index}/{total}: metrics on http://{http.address}/metrics, status on "
        f"http://{http.address}/api/status{' (bearer token required)' if http.authenticated else ''}",
        flush=True,
    )
    return monitor.on_task, monitor.on_event, http


def serve_client(
    factory: ClientFactory, args: argparse.Namespace, config: Config, options: dict[str, Any]
) -> int:
    """Builds the client from ``factory`` and serves the coordinator's tasks until the run ends.

    Args:
        factory: the client factory (an ``--app``'s or the built-in one).
        args: ``fedgrid client``'s flags (the coordinator, TLS files, ``--state-dir``, ``--http``).
        config: the client's settings (``--config`` and flags).
        options: the factory's keyword options.
    Returns:
        The exit status: 0 when the run finished or a signal stopped the client.
    Raises:
        ConfigError: incomplete or unreadable TLS files, a bad ``--http``, an app's capabilities.
    """
    from fedgrid.client.parallel import torchrun_rank

    client = _build(factory, args, config, options)
    if args.ca and args.cert and args.key and torchrun_rank() is None:
        client = _with_secagg(client, args)
    index, _ = parse_partition(args.partition)
    state_path = Path(args.state_dir) / f"client-{index}.pt" if args.state_dir else None

    def interrupt(signal_name: str) -> None:
        raise KeyboardInterrupt(signal_name)  # unwinds run(), which tells the coordinator it leaves

    http = None
    try:
        on_task, on_event, http = _monitor(args, client)
        serve_tasks = _task_server(args, state_path, on_task, on_event)
        with GracefulStop(interrupt, what="client"):
            if torchrun_rank() is not None:  # rank 0 serves the coordinator's tasks, the other ranks rank 0's
                from fedgrid.client.parallel import serve_torchrun

                summary = serve_torchrun(client, parallel_spec(config), serve_tasks)
                if summary is None:
                    return 0
            else:
                summary = serve_tasks(client)
    except KeyboardInterrupt:
        print(f"client {client.name}: stopped; left the federation", flush=True)
        return 0
    except ValueError as exc:
        if isinstance(exc, FedgridError):
            raise
        raise ConfigError(
            "cert", str(exc)
        ) from None  # TLS files incomplete or unreadable (the message names the file)
    finally:
        if http is not None:
            http.stop()
        if hasattr(client, "close"):
            client.close()  # a ParallelClient's workers
    print(f"client {client.name}: {summary.rounds} rounds trained; run finished")
    return 0


def _with_secagg(client: Any, args: argparse.Namespace) -> Any:
    """Under mutual TLS, the client takes part in SecAgg+ rounds (``--secagg`` on the
    coordinator) under its certificate's identity (``fedgrid.client.secagg.from_certificate``);
    any other task goes to it unchanged. Files the TLS setup reads are checked there: one that
    cannot serve here leaves the client without secure aggregation, with a warning."""
    from fedgrid.client.secagg import from_certificate

    try:
        return from_certificate(
            client,
            ca_pem=Path(args.ca).read_bytes(),
            cert_pem=Path(args.cert).read_bytes(),
            key_pem=Path(args.key).read_bytes(),
        )
    except (OSError, ValueError, TypeError) as exc:
        log.warning(
            "client %s: no secure aggregation: its certificate cannot sign key adverts (%s)", client.name, exc
        )
        return client


def _task_server(
    args: argparse.Namespace,
    state_path: Path | None,
    on_task: Callable[[Any], None] | None,
    on_event: Callable[[Any], None] | None,
) -> Callable[[Any], Any]:
    """What serves the coordinator's tasks to a client: ``runtime.run_client`` with the flags'
    coordinator, TLS files, connect timeout and give-up bound, the client's state path and its
    monitor's hooks."""
    timeout = {} if args.connect_timeout_s is None else {"connect_timeout": args.connect_timeout_s}
    if getattr(args, "give_up_after_s", None) is not None:
        timeout["retry_max_elapsed"] = args.give_up_after_s

    def serve_tasks(member: Any) -> Any:
        return runtime.run_client(
            member,
            coordinator=args.coordinator,
            state_path=state_path,
            ca=args.ca,
            cert=args.cert,
            key=args.key,
            server_name=args.server_name,
            on_task=on_task,
            on_event=on_event,
            **timeout,
        )

    return serve_tasks


#: Where ``fedgrid client`` finds an enrollment token that is not on its command line.
ENROLL_TOKEN_ENV = "FEDGRID_ENROLL_TOKEN"
#: Longest token file read (a token is about 60 characters).
MAX_TOKEN_FILE_BYTES = 4096


def enroll_token(args: argparse.Namespace) -> str:
    """The enrollment token: ``--enroll``, else ``--enroll-file``, else ``$FEDGRID_ENROLL_TOKEN``
    ("" for none). A token on the command line works, with a warning: other local users can read
    it in ``ps`` until it is spent."""
    if args.enroll and args.enroll_file:
        raise ConfigError("enroll", "give the token once: --enroll TOKEN or --enroll-file FILE, not both")
    if args.enroll:
        print(
            "fedgrid client: warning: the token on the command line is visible to other users of this machine "
            f"until it is spent; prefer --enroll-file FILE or ${ENROLL_TOKEN_ENV}",
            file=sys.stderr,
        )
        return str(args.enroll)
    if args.enroll_file:
        try:
            with open(args.enroll_file, "rb") as f:
                data = f.read(MAX_TOKEN_FILE_BYTES + 1)
        except OSError as exc:
            raise ConfigError("enroll_file", f"cannot read {args.enroll_file}: {exc.strerror}") from None
        if len(data) > MAX_TOKEN_FILE_BYTES:
            raise ConfigError(
                "enroll_file", f"{args.enroll_file} is over {MAX_TOKEN_FILE_BYTES} bytes: not a token file"
            )
        token = data.decode("ascii", "replace").strip()
        if not token:
            raise ConfigError("enroll_file", f"{args.enroll_file} is empty")
        return token
    return os.environ.get(ENROLL_TOKEN_ENV, "").strip()


def enroll_client(args: argparse.Namespace) -> None:
    """``fedgrid client --enroll``: the device's certificate, once (``fedgrid.client.enroll``)."""
    from fedgrid.client.enroll import enroll

    if not args.enroll:
        raise ConfigError(
            "enroll",
            "--enroll-address and --name go with --enroll TOKEN, --enroll-file FILE or "
            f"${ENROLL_TOKEN_ENV} (under mTLS the certificate names the client)",
        )
    missing = [
        flag
        for flag, value in (
            ("--enroll-address", args.enroll_address),
            ("--ca", args.ca),
            ("--cert", args.cert),
            ("--key", args.key),
        )
        if not value
    ]
    if missing:
        raise ConfigError(
            "enroll",
            f"--enroll needs {', '.join(missing)}: the enrollment service, the CA bundle that signs "
            "the coordinator, and where this client's certificate and key go",
        )
    try:
        identity = enroll(
            args.enroll_address,
            args.enroll,
            ca=args.ca,
            cert=args.cert,
            key=args.key,
            server_name=args.server_name,
            name=args.name,
        )
    except ValueError as exc:
        if isinstance(exc, FedgridError):  # PKIError: a file named in the message
            raise
        raise ConfigError("enroll" if args.name is None else "name", str(exc)) from None
    print(f"fedgrid client: identity {identity!r} (certificate {args.cert}, key {args.key})", flush=True)
