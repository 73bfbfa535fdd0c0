"""The ``fedgrid`` command: ``simulate``, ``coordinator`` and ``client``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Sequence

from fedgrid.config import Config, config_keys, key_type, load_config
from fedgrid.errors import ConfigError, FedgridError

__all__ = ["main", "build_parser"]

# Keys each subcommand exposes as flags; every key is also accepted through --config.
SIMULATE_KEYS = [k for k in config_keys() if k not in ("listen", "max_workers", "min_clients", "state_dir", "heartbeat_interval_s")]
COORDINATOR_KEYS = [k for k in config_keys() if k != "clients"]


def _add_config_flags(parser: argparse.ArgumentParser, keys: Sequence[str]) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML file; flags override its keys")
    fields = config_keys()
    for key in keys:
        f = fields[key]
        kind, optional = key_type(f)
        default = "the strategy's" if optional and f.default is None else repr(f.default)
        parser.add_argument(
            "--" + key.replace("_", "-"),
            dest=key,
            metavar=kind.__name__.upper(),
            default=None,
            help=f"{f.metadata['help']} (default: {default})",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedgrid", description="Federated training for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="run a whole federation in this process")
    _add_config_flags(sim, SIMULATE_KEYS)

    coord = sub.add_parser("coordinator", help="serve rounds to clients over gRPC")
    _add_config_flags(coord, COORDINATOR_KEYS)

    cli = sub.add_parser("client", help="join a coordinator and train")
    cli.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    cli.add_argument("--app", metavar="MODULE:FACTORY", help="client factory(partition, num_partitions, seed) -> Client; default: built-in digits")
    cli.add_argument("--partition", default="0/1", metavar="I/N", help="take partition I of N (default 0/1)")
    cli.add_argument("--seed", type=int, default=0)
    cli.add_argument("--data-partition", dest="partitioner", default=None, metavar="SPEC", help="iid or dirichlet:ALPHA (built-in task)")
    cli.add_argument("--region", default="")
    return parser


def _config_from(args: argparse.Namespace, keys: Sequence[str]) -> Config:
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if not overrides.get("out"):
        overrides["out"] = f"runs/{args.command}-{time.strftime('%Y%m%d-%H%M%S')}"
    return load_config(args.config, overrides)


def _simulate(args: argparse.Namespace) -> int:
    from fedgrid.simulation.run import run_simulation

    config = _config_from(args, SIMULATE_KEYS)
    print(f"fedgrid simulate: {config.clients} clients, {config.rounds} rounds, task {config.task}, partition {config.partition}, seed {config.seed}")

    def show(m):
        acc = "" if m.accuracy is None else f" accuracy {m.accuracy:.4f}"
        loss = "" if m.loss is None else f" loss {m.loss:.4f}"
        print(f"round {m.round:3d}/{config.rounds}{loss}{acc} clients {m.clients_ok} ok {m.clients_failed} failed  up {m.bytes_up / 1e6:.2f} MB down {m.bytes_down / 1e6:.2f} MB  {m.wall_s:.2f}s", flush=True)

    _, history = run_simulation(config, on_round=show)
    final = history[-1]
    print(f"final test accuracy {final.accuracy:.4f}; run directory {config.out}")
    return 0


def _coordinator(args: argparse.Namespace) -> int:
    from fedgrid.server.app import run_coordinator

    config = _config_from(args, COORDINATOR_KEYS)
    run_coordinator(config)
    return 0


def _client(args: argparse.Namespace) -> int:
    from fedgrid.client.runtime import load_app, run

    try:
        index_s, total_s = args.partition.split("/")
        index, total = int(index_s), int(total_s)
    except ValueError:
        raise ConfigError("partition", f"expected I/N, got {args.partition!r}") from None
    if not 0 <= index < total:
        raise ConfigError("partition", f"index {index} is outside 0..{total - 1}")
    factory = load_app(args.app)
    kwargs = {"partitioner": args.partitioner} if args.partitioner else {}
    client = factory(index, total, args.seed, **kwargs)
    if args.region:
        client.region = args.region
    summary = run(client, coordinator=args.coordinator)
    print(f"client {client.name}: {summary.rounds} rounds trained; run finished")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # simulate prints its own progress lines; the services log what they do.
    quiet = args.command == "simulate"
    level = logging.DEBUG if args.verbose else (logging.WARNING if quiet else logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return {"simulate": _simulate, "coordinator": _coordinator, "client": _client}[args.command](args)
    except ConfigError as exc:
        print(f"fedgrid: error: {exc}", file=sys.stderr)
        return 2
    except FedgridError as exc:
        print(f"fedgrid: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
