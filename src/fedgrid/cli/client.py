"""``fedgrid client``: join a coordinator and train (the wiring is ``fedgrid.client.serve``)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from fedgrid.cli.support import CLIENT_CONFIG_KEYS, CLIENT_OPTION_KEYS, add_config_flags
from fedgrid.config import CLIENT_ONLY_KEYS, Config, load_config, parse_flags

__all__ = ["add_parser", "client_config", "client_options", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds ``fedgrid client`` and its flags to ``sub`` (the subcommands); returns its parser."""
    cli = sub.add_parser("client", help="join a coordinator and train")
    cli.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file: its " + ", ".join(CLIENT_CONFIG_KEYS) + " apply; flags override them",
    )
    _add_connection_flags(cli)
    _add_data_flags(cli)
    _add_tls_flags(cli)
    _add_enrollment_flags(cli)
    add_config_flags(
        cli, [*CLIENT_OPTION_KEYS, "quiet", "threads", *sorted(CLIENT_ONLY_KEYS)], with_config=False
    )
    _add_state_and_monitoring_flags(cli)
    return cli


def _add_connection_flags(cli: argparse.ArgumentParser) -> None:
    """The coordinator to join and how long to try."""
    cli.add_argument(
        "--coordinator",
        required=True,
        metavar="HOST:PORT",
        help="the coordinator's address, as it prints it (and writes to RUN_DIR/address)",
    )
    cli.add_argument(
        "--connect-timeout-s",
        dest="connect_timeout_s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="give up when the coordinator cannot be reached for this long before the first join "
        "(default: 60, FEDGRID_CONNECT_TIMEOUT_S)",
    )
    cli.add_argument(
        "--give-up-after-s",
        dest="give_up_after_s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="once joined, give up when the coordinator has not answered for this long (a coordinator "
        "stopped without --state-dir never comes back), saying what the client waited for "
        "(default: 120, FEDGRID_RETRY_MAX_ELAPSED_S)",
    )


def _add_data_flags(cli: argparse.ArgumentParser) -> None:
    """The client factory, its data partition and seed, and the client's region."""
    cli.add_argument(
        "--app",
        metavar="MODULE:FACTORY",
        help="client factory(partition, num_partitions, seed) -> Client; default: built-in digits",
    )
    cli.add_argument("--partition", default="0/1", metavar="I/N", help="take partition I of N (default 0/1)")
    cli.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the seed of the data partition and shuffling: the coordinator's "
        "--seed, so that partition I/N is the same data in every client (default 0)",
    )
    cli.add_argument(
        "--data-partition",
        dest="partitioner",
        default=None,
        metavar="SPEC",
        help="iid, dirichlet:ALPHA, shards:N or natural (built-in datasets); hf:PATH data: iid, "
        "dirichlet:A:label=COL, shard:K or natural:COL",
    )
    cli.add_argument(
        "--region",
        default="",
        help="this client's region label, for region-balanced selection and "
        "--region-codecs on the coordinator (default: none)",
    )


def _add_tls_flags(cli: argparse.ArgumentParser) -> None:
    """Mutual TLS: the CA bundle, this client's certificate and key, the coordinator's name."""
    cli.add_argument(
        "--ca",
        default=None,
        metavar="FILE",
        help="mutual TLS: PEM CA bundle that signs the coordinator's certificate",
    )
    cli.add_argument(
        "--cert",
        default=None,
        metavar="FILE",
        help="mutual TLS: this client's certificate (its identity is the client's name)",
    )
    cli.add_argument("--key", default=None, metavar="FILE", help="mutual TLS: this client's private key")
    cli.add_argument(
        "--insecure",
        action="store_true",
        help="connect in plaintext to a coordinator off loopback (anyone on the path can read and change "
        "the model); without it, such a coordinator needs --ca/--cert/--key",
    )
    cli.add_argument(
        "--server-name",
        dest="server_name",
        default="",
        metavar="NAME",
        help="the name the coordinator's certificate holds, when not the host of --coordinator",
    )


def _add_enrollment_flags(cli: argparse.ArgumentParser) -> None:
    """Enrollment: a one-time token traded for a certificate before the client joins."""
    cli.add_argument(
        "--enroll",
        default="",
        metavar="TOKEN",
        help="enroll first: trade this one-time token (fedgrid certs token) for a certificate, written to --cert "
        "with a key made here in --key (0600); skipped when --cert and --key already hold a valid identity. "
        "A command line is visible to every local user: prefer --enroll-file or $FEDGRID_ENROLL_TOKEN",
    )
    cli.add_argument(
        "--enroll-file",
        dest="enroll_file",
        default="",
        metavar="FILE",
        help="like --enroll, the token read from FILE (fedgrid certs token --out; a container secret)",
    )
    cli.add_argument(
        "--enroll-address",
        dest="enroll_address",
        default="",
        metavar="HOST:PORT",
        help="the coordinator's enrollment service (its --enroll-listen)",
    )
    cli.add_argument(
        "--name",
        default=None,
        metavar="NAME",
        help="with --enroll: the identity to ask for (the token's name if it was issued with one; default client-TOKEN_ID)",
    )


def _add_state_and_monitoring_flags(cli: argparse.ArgumentParser) -> None:
    """The client's saved state across rounds and its read-only HTTP monitor."""
    cli.add_argument(
        "--state-dir",
        dest="state_dir",
        default=None,
        metavar="DIR",
        help="save the client's state across rounds (error-feedback residuals, the client's own state) to "
        "DIR/client-I.pt after every round and resume from it on restart (default: memory only)",
    )
    cli.add_argument(
        "--http",
        default="",
        metavar="HOST:PORT",
        help="serve this client's /metrics (Prometheus) and /api/status (JSON) here, read-only (needs the monitor "
        "extra; port 0: a free one)",
    )
    cli.add_argument(
        "--http-token-file",
        dest="http_token_file",
        default="",
        metavar="FILE",
        help="with --http: the bearer token /metrics and /api/status ask for (required on a non-loopback host)",
    )


def client_config(args: argparse.Namespace) -> Config:
    """``fedgrid client``'s settings: ``--config``'s file, then the flags given."""
    # --partition is the client's I/N; the data partition (the key "partition") is --data-partition.
    given = parse_flags({k: getattr(args, k, None) for k in CLIENT_CONFIG_KEYS if k != "partition"})
    if args.partitioner:
        given["partition"] = args.partitioner
    return load_config(args.config, given)


def client_options(args: argparse.Namespace, config: Config | None = None) -> dict[str, Any]:
    """The client factory's options, checked as config keys: the built-in factory gets all of
    them as one ``ClientOptions`` (the file's and the defaults included), an ``--app`` only the
    flags given, as keywords (as ``fedgrid simulate`` gives an app none of the file's)."""
    from fedgrid.simulation.tasks import check_config
    from fedgrid.simulation.tasks import client_options as factory_options

    given = [k for k in CLIENT_OPTION_KEYS if getattr(args, k, None) is not None] + (
        ["partition"] if args.partitioner else []
    )
    config = config if config is not None else client_config(args)
    check_config(config)
    options = factory_options(config)
    if args.app is None:
        return {"options": options}
    return {
        ("partitioner" if k == "partition" else k): getattr(options, "partitioner" if k == "partition" else k)
        for k in given
    }


def run(args: argparse.Namespace) -> int:
    """``fedgrid client``: checks the flags, enrolls (rank 0, before any data or model is
    loaded, so a refused token fails fast), then serves with the ``--app`` factory or the
    built-in one."""
    from fedgrid.client.parallel import torchrun_rank
    from fedgrid.client.serve import (
        check_addresses,
        enroll_client,
        enroll_token,
        parse_partition,
        serve_client,
    )
    from fedgrid.plugins import load_object

    config = client_config(args)
    if config.quiet:  # no progress lines inside a task (fedgrid.client.progress)
        logging.getLogger("fedgrid.client.progress").setLevel(logging.WARNING)
    args.ca, args.cert, args.key = config.ca, config.cert, config.key
    check_addresses(args)
    parse_partition(args.partition)
    rank = torchrun_rank()
    if rank is None or rank[0] == 0:  # rank 0 enrolls; the others train with the files it wrote
        args.enroll = enroll_token(args)
        if args.enroll or args.enroll_address or args.name is not None:
            enroll_client(args)
    import torch

    if config.threads:
        torch.set_num_threads(config.threads)  # before any work: data loading and model init included
    if args.app:
        factory = load_object(args.app, key="app")
    else:
        from fedgrid.simulation.tasks import builtin_client

        factory = builtin_client
    return serve_client(factory, args, config, client_options(args, config))
