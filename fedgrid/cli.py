"""The ``fedgrid`` command: ``simulate``, ``coordinator``, ``region``, ``client``, ``certs`` (the CA for mutual TLS), ``report`` (plots of run directories), ``new`` (an app template), ``status`` (a running coordinator), ``wan`` (an emulated WAN link, ``fedgrid.wan``), ``health`` (is it serving) and ``launch`` (a whole topology as local processes)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from typing import Any, Callable, Sequence, TextIO

from fedgrid import health, launch
from fedgrid.cli_support import FedgridParser, error_line, package_version, with_default_out
from fedgrid.config import CLIENT_ONLY_KEYS, COORDINATOR_ONLY_KEYS, REGION_ONLY_KEYS, SIMULATION_ONLY_KEYS, Config, config_keys, key_type, load_config
from fedgrid.errors import ConfigError, FedgridError
from fedgrid.interrupts import FORCED_EXIT_STATUS, GracefulStop, say
from fedgrid.types import ModelState, RoundMetrics
from fedgrid.wan import add_arguments as add_wan_arguments
from fedgrid.wan import command as wan_command

__all__ = ["main", "build_parser", "serve", "SimulateProgress"]

# Keys each subcommand exposes as flags; every key is also accepted through --config.
SIMULATE_KEYS = [k for k in config_keys() if k not in COORDINATOR_ONLY_KEYS | CLIENT_ONLY_KEYS | REGION_ONLY_KEYS]
COORDINATOR_KEYS = [k for k in config_keys() if k not in SIMULATION_ONLY_KEYS | CLIENT_ONLY_KEYS | REGION_ONLY_KEYS]
#: ``fedgrid region``: a coordinator's keys for its own clients (not the global run's length, model or
#: enrollment and status servers, which the global coordinator has), and its upstream link.
REGION_KEYS = [k for k in COORDINATOR_KEYS if k not in ("rounds", "initial_model", "model", "enroll_listen", "enroll_dir", "http",
                                                        "http_token_file")] + ["regional_rounds", *sorted(REGION_ONLY_KEYS)]
# The built-in client factory's options (fedgrid.simulation.tasks.CLIENT_KEYS) as `fedgrid
# client` flags, so a deployed client trains like its simulated twin; --data-partition is the spec.
CLIENT_OPTION_KEYS = ["dataset", "data_dir", "model", "batch_size", "optimizer", "lr", "momentum", "weight_decay"]
#: What ``fedgrid client --config FILE`` takes from the file (flags override it); the file's
#: other keys (a TOML shared with the coordinator) are checked and left alone.
CLIENT_CONFIG_KEYS = [*CLIENT_OPTION_KEYS, "partition", "threads", "ca", "cert", "key", *sorted(CLIENT_ONLY_KEYS)]


def _add_config_flags(parser: argparse.ArgumentParser, keys: Sequence[str], *, with_config: bool = True) -> None:
    if with_config:
        parser.add_argument("--config", metavar="FILE", help="TOML file; flags override its keys")
    fields = config_keys()
    for key in keys:
        f = fields[key]
        kind, optional = key_type(f)
        default = "the strategy's" if optional and f.default is None else repr(f.default)
        # A bare boolean flag means true (--insecure); --insecure false still parses.
        flag: dict[str, Any] = {"nargs": "?", "const": "true"} if kind is bool else {}
        parser.add_argument(
            "--" + key.replace("_", "-"),
            dest=key,
            metavar=kind.__name__.upper(),
            default=None,
            help=f"{f.metadata['help']} (default: {default})",
            **flag,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = FedgridParser(prog="fedgrid", description="Federated training for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"fedgrid {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="run a whole federation in this process")
    _add_config_flags(sim, SIMULATE_KEYS)

    coord = sub.add_parser("coordinator", help="serve rounds to clients over gRPC")
    _add_config_flags(coord, COORDINATOR_KEYS)

    region = sub.add_parser("region", help="coordinate a region's clients and join the global coordinator as one client")
    _add_config_flags(region, REGION_KEYS)

    cli = sub.add_parser("client", help="join a coordinator and train")
    cli.add_argument("--config", metavar="FILE", help="TOML file: its " + ", ".join(CLIENT_CONFIG_KEYS) + " apply; flags override them")
    cli.add_argument("--coordinator", required=True, metavar="HOST:PORT",
                     help="the coordinator's address, as it prints it (and writes to RUN_DIR/address)")
    cli.add_argument("--connect-timeout-s", dest="connect_timeout_s", type=float, default=None, metavar="SECONDS",
                     help="give up when the coordinator cannot be reached for this long before the first join "
                     "(default: 60, FEDGRID_CONNECT_TIMEOUT_S)")
    cli.add_argument("--app", metavar="MODULE:FACTORY", help="client factory(partition, num_partitions, seed) -> Client; default: built-in digits")
    cli.add_argument("--partition", default="0/1", metavar="I/N", help="take partition I of N (default 0/1)")
    cli.add_argument("--seed", type=int, default=0, help="the seed of the data partition and shuffling: the coordinator's "
                     "--seed, so that partition I/N is the same data in every client (default 0)")
    cli.add_argument("--data-partition", dest="partitioner", default=None, metavar="SPEC", help="iid, dirichlet:ALPHA, shards:N or natural (built-in datasets)")
    cli.add_argument("--region", default="", help="this client's region label, for region-balanced selection and "
                     "--region-codecs on the coordinator (default: none)")
    cli.add_argument("--ca", default=None, metavar="FILE", help="mutual TLS: PEM CA bundle that signs the coordinator's certificate")
    cli.add_argument("--cert", default=None, metavar="FILE", help="mutual TLS: this client's certificate (its identity is the client's name)")
    cli.add_argument("--key", default=None, metavar="FILE", help="mutual TLS: this client's private key")
    cli.add_argument("--server-name", dest="server_name", default="", metavar="NAME",
                     help="the name the coordinator's certificate holds, when not the host of --coordinator")
    cli.add_argument("--enroll", default="", metavar="TOKEN",
                     help="enroll first: trade this one-time token (fedgrid certs token) for a certificate, written to --cert "
                     "with a key made here in --key (0600); skipped when --cert and --key already hold a valid identity. "
                     "A command line is visible to every local user: prefer --enroll-file or $FEDGRID_ENROLL_TOKEN")
    cli.add_argument("--enroll-file", dest="enroll_file", default="", metavar="FILE",
                     help="like --enroll, the token read from FILE (fedgrid certs token --out; a container secret)")
    cli.add_argument("--enroll-address", dest="enroll_address", default="", metavar="HOST:PORT",
                     help="the coordinator's enrollment service (its --enroll-listen)")
    cli.add_argument("--name", default=None, metavar="NAME",
                     help="with --enroll: the identity to ask for (the token's name if it was issued with one; default client-TOKEN_ID)")
    _add_config_flags(cli, [*CLIENT_OPTION_KEYS, "threads", *sorted(CLIENT_ONLY_KEYS)], with_config=False)
    cli.add_argument(
        "--state-dir", dest="state_dir", default=None, metavar="DIR",
        help="save the client's state across rounds (error-feedback residuals, the client's own state) to "
        "DIR/client-I.pt after every round and resume from it on restart (default: memory only)",
    )
    cli.add_argument("--http", default="", metavar="HOST:PORT",
                     help="serve this client's /metrics (Prometheus) and /api/status (JSON) here, read-only (needs the monitor "
                     "extra; port 0: a free one)")
    cli.add_argument("--http-token-file", dest="http_token_file", default="", metavar="FILE",
                     help="with --http: the bearer token /metrics and /api/status ask for (required on a non-loopback host)")
    _add_certs_parser(sub)
    rep = sub.add_parser("report", help="plot run directories: PNG files and one self-contained HTML page")
    rep.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (metrics.jsonl), overlaid in one plot per metric")
    rep.add_argument("--out", default="report", metavar="DIR", help="where the PNGs and report.html go (default: ./report)")
    rep.add_argument("--label", action="append", default=[], metavar="NAME",
                     help="the legend name of a run, once per RUN_DIR in order (default: the directory's name)")
    new = sub.add_parser("new", help="write a runnable app template into ./NAME/ (model, client factory, data, config.toml)")
    new.add_argument("name", metavar="NAME", help="the app's package name: a Python identifier, not an existing directory")
    status = sub.add_parser("status", help="show a running coordinator's round, progress and clients (its --http address)")
    status.add_argument("address", metavar="ADDRESS", help="HOST:PORT of the coordinator's --http server")
    status.add_argument("--watch", action="store_true", help="redraw until Ctrl-C")
    status.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between redraws with --watch (default 2)")
    status.add_argument("--token-file", dest="token_file", default="", metavar="FILE", help="the coordinator's http_token_file")
    wan = sub.add_parser("wan", help="relay TCP to --target through an emulated WAN link (delay, bandwidth, loss); until SIGTERM")
    add_wan_arguments(wan)
    health.add_parser(sub)
    launch.add_parser(sub)
    return parser


def _add_certs_parser(sub: Any) -> None:
    certs = sub.add_parser("certs", help="the certificate authority for mutual TLS: certificates, revocation, enrollment tokens")
    csub = certs.add_subparsers(dest="certs_command", required=True, metavar="{init,issue,revoke,list,token,revoke-token}")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = csub.add_parser(name, help=help, description=help)
        p.add_argument("--dir", required=True, metavar="DIR", help="the certificate directory")
        return p

    init = command("init", "create a CA in DIR: ca.pem, ca.key, crl.pem, index.json, tokens.json")
    init.add_argument("--name", default="fedgrid CA", help="the CA's common name (default: fedgrid CA)")
    init.add_argument("--days", type=int, default=3650, help="validity in days (default: 3650)")
    issue = command("issue", "issue a client (default) or server certificate: DIR/NAME.pem and DIR/NAME.key")
    issue.add_argument("--name", required=True, help="the client identity, or the server's name")
    issue.add_argument("--server", action="store_true", help="a server certificate (EKU serverAuth) instead of a client one")
    issue.add_argument("--san", action="append", default=[], metavar="HOST",
                       help="a server's DNS name or IP address; repeat for more (default: localhost and 127.0.0.1)")
    issue.add_argument("--days", type=int, default=365, help="validity in days (default: 365)")
    revoke = command("revoke", "revoke NAME's certificate and rewrite DIR/crl.pem")
    revoke.add_argument("--name", required=True)
    command("list", "list the certificates issued: name, kind, serial, expiry, status")
    token = command("token", "print a one-time enrollment token (shown once: only its hash is kept)")
    token.add_argument("--name", default=None, help="the only identity the token may enroll (default: any)")
    token.add_argument("--expires", default="24h", metavar="DURATION", help="e.g. 30m, 24h, 7d (default: 24h)")
    token.add_argument("--out", default="", metavar="FILE",
                       help="write the token to FILE (new, mode 0600) for fedgrid client --enroll-file, instead of printing it")
    revoke_token = command("revoke-token", "revoke an enrollment token by its id (the part before the dot)")
    revoke_token.add_argument("--id", dest="token_id", required=True, metavar="TOKEN_ID")


def _config_from(args: argparse.Namespace, keys: Sequence[str]) -> Config:
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    return with_default_out(load_config(args.config, overrides), args.command)


class SimulateProgress:
    """``fedgrid simulate``'s progress line after each round: round r/R, client updates per
    second, the latest accuracy and loss, and the time left (mean round time so far times
    the rounds left). On a terminal it is one line rewritten in place; otherwise one plain
    line per round.

    Args:
        rounds: the run's rounds.
        stream: where the line goes (stderr).
    """

    def __init__(self, rounds: int, stream: TextIO) -> None:
        self.rounds = rounds
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._walls: list[float] = []
        self._shown = False

    @staticmethod
    def line(m: RoundMetrics, rounds: int, eta_s: float) -> str:
        from fedgrid.simulation.run import clients_per_second

        acc = "-" if m.accuracy is None else f"{m.accuracy:.4f}"
        loss = "-" if m.loss is None else f"{m.loss:.4f}"
        minutes, seconds = divmod(int(round(eta_s)), 60)
        return (
            f"round {m.round}/{rounds} | {clients_per_second(m):.1f} clients/s | accuracy {acc} | loss {loss} | "
            f"ETA {minutes // 60}:{minutes % 60:02d}:{seconds:02d}"
        )

    def clear(self) -> None:
        """Takes the in-place line away (before other output on the terminal)."""
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False

    def update(self, m: RoundMetrics) -> None:
        self._walls.append(m.wall_s)
        eta = sum(self._walls) / len(self._walls) * max(self.rounds - m.round, 0)
        text = self.line(m, self.rounds, eta)
        if self.tty:
            self.stream.write("\r" + text + "\033[K")
            self._shown = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Ends the in-place line so that later output starts on a line of its own."""
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False


def _simulate(args: argparse.Namespace) -> int:
    import torch

    from fedgrid.simulation.run import run_simulation
    from fedgrid.simulation.tasks import check_config, get_task

    config = _config_from(args, SIMULATE_KEYS)
    check_config(config)
    task = get_task(config.dataset)

    def header(engine: str, why: str) -> None:  # once the engine is chosen: auto's choice shows
        chosen = f"engine {engine} ({why})" if config.engine == "auto" else f"engine {engine}"
        print(
            f"fedgrid simulate: {config.clients} clients, {config.rounds} rounds, dataset {config.dataset}, "
            f"model {config.model or task.default_model}, partition {config.partition or task.default_partition}, "
            f"{chosen}, seed {config.seed}, {config.threads or torch.get_num_threads()} threads", flush=True,
        )

    progress = SimulateProgress(config.rounds, sys.stderr) if config.progress else None
    stop = threading.Event()

    def on_stop(signal_name: str) -> None:
        erase = "\r\033[K" if progress is not None and progress.tty else ""  # the in-place line, without writing into its stream
        say(f"{erase}{signal_name}: stopping after the current round; a second one exits at once")
        stop.set()

    def show(m: RoundMetrics) -> None:
        acc = "" if m.accuracy is None else f" accuracy {m.accuracy:.4f}"
        loss = "" if m.loss is None else f" loss {m.loss:.4f}"
        if progress is not None:
            progress.clear()
        print(f"round {m.round:3d}/{config.rounds}{loss}{acc} clients {m.clients_ok} ok {m.clients_failed} failed  up {m.bytes_up / 1e6:.2f} MB down {m.bytes_down / 1e6:.2f} MB  {m.wall_s:.2f}s", flush=True)
        if progress is not None:
            progress.update(m)

    from datetime import timedelta

    import torch.distributed as dist

    from fedgrid.client.parallel import torchrun_rank

    ranks = torchrun_rank()
    if ranks is not None:  # torchrun: each rank trains its share of the clients (fedgrid.simulation.sharded)
        dist.init_process_group("gloo", timeout=timedelta(seconds=config.round_timeout_s))
    quiet = ranks is not None and ranks[0] != 0  # rank 0 speaks for the run
    if quiet:
        progress = None
    with GracefulStop(on_stop, what="simulate"):
        try:
            final_model, history = run_simulation(config, on_round=None if quiet else show, on_start=None if quiet else header, stop=stop)
            if ranks is not None:
                # Every rank past the last collective before any tears gloo down: a rank that
                # exits while a peer's gather is in flight aborts that peer.
                dist.barrier()
        finally:
            if progress is not None:
                progress.close()
            if ranks is not None:
                dist.destroy_process_group()
    if quiet:
        return 0
    if final_model is None:
        saved = f"; model of round {len(history)} in {config.out}/model.safetensors" if history else ""
        print(f"stopped after {len(history)} of {config.rounds} rounds{saved}; run directory {config.out}")
        return 0
    final = history[-1]
    metric = f"final test accuracy {final.accuracy:.4f}" if final.accuracy is not None else f"final loss {final.loss}"
    print(f"{metric}; run directory {config.out}")
    return 0


def _client_config(args: argparse.Namespace) -> Config:
    """``fedgrid client``'s settings: ``--config``'s file, then the flags given."""
    # --partition is the client's I/N; the data partition (the key "partition") is --data-partition.
    given = {k: getattr(args, k) for k in CLIENT_CONFIG_KEYS if k != "partition" and getattr(args, k, None) is not None}
    if args.partitioner:
        given["partition"] = args.partitioner
    return load_config(args.config, given)


def _client_options(args: argparse.Namespace, config: Config | None = None) -> dict[str, Any]:
    """The client factory's options, checked as config keys: the built-in factory gets all of
    them (the file's and the defaults included), an ``--app`` only the flags given (as
    ``fedgrid simulate`` gives an app none of the file's)."""
    from fedgrid.simulation.tasks import check_config, client_options

    given = [k for k in CLIENT_OPTION_KEYS if getattr(args, k, None) is not None] + (["partition"] if args.partitioner else [])
    config = config if config is not None else _client_config(args)
    check_config(config)
    options = client_options(config)
    if args.app is None:
        return options
    return {("partitioner" if k == "partition" else k): options["partitioner" if k == "partition" else k] for k in given}


def serve(config: Config, **kwargs: Any) -> ModelState | None:
    """``fedgrid coordinator``: ``run_coordinator`` with the initial model from an
    ``initial_model`` file or a ``MODULE:FACTORY`` (no dataset code imported), else from
    the built-in dataset's model, with its server-side evaluation. ``kwargs`` go to
    ``run_coordinator`` (``ready``, ``on_event``)."""
    from fedgrid.server.app import coordinator_model, run_coordinator

    initial = coordinator_model(config)
    if initial is not None:
        return run_coordinator(config, initial=initial, **kwargs)
    from fedgrid.simulation.tasks import check_config, resolve

    check_config(config)
    resolved = resolve(dataset=config.dataset, model=config.model, seed=config.seed, data_dir=config.data_dir)
    return run_coordinator(config, initial=resolved.initial_state, evaluate_fn=resolved.evaluate, **kwargs)


def _parallel_spec(config: Config) -> Any:
    """The client's ``ParallelSpec`` from its keys; under torchrun, its world size is the ranks'.

    Raises:
        ConfigError: a bad ``parallel``, ``comm_hook`` or rank count (the key named).
    """
    from fedgrid.client.parallel import ParallelSpec, torchrun_rank

    ranks = torchrun_rank()
    nproc = ranks[2] if ranks is not None else config.nproc_per_node
    try:
        return ParallelSpec.parse(nproc, config.parallel, comm_hook=config.comm_hook, collective_timeout_s=config.collective_timeout_s)
    except ValueError as exc:
        key = next((k for k in ("comm_hook", "nproc_per_node", "collective_timeout_s") if str(exc).startswith(k)), "parallel")
        raise ConfigError(key, str(exc)) from None


def _region(args: argparse.Namespace) -> int:
    from fedgrid.region import run_region

    run_region(_config_from(args, REGION_KEYS))
    return 0


def _coordinator(args: argparse.Namespace) -> int:
    serve(_config_from(args, COORDINATOR_KEYS))
    return 0


def _client(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fedgrid.client.parallel import torchrun_rank
    from fedgrid.client.runtime import check_target, run
    from fedgrid.plugins import load_object

    config = _client_config(args)
    args.ca, args.cert, args.key = config.ca, config.cert, config.key
    try:
        check_target(args.coordinator)
    except ValueError as exc:
        raise ConfigError("coordinator", str(exc)) from None
    if args.enroll_address:
        try:
            check_target(args.enroll_address, what="enrollment")
        except ValueError as exc:
            raise ConfigError("enroll_address", str(exc)) from None

    try:
        index_s, total_s = args.partition.split("/")
        index, total = int(index_s), int(total_s)
    except ValueError:
        raise ConfigError("partition", f"expected I/N, got {args.partition!r}") from None
    if not 0 <= index < total:
        raise ConfigError("partition", f"index {index} is outside 0..{total - 1}")
    rank = torchrun_rank()
    if rank is None or rank[0] == 0:  # rank 0 enrolls; the others train with the files it wrote
        args.enroll = _enroll_token(args)
        if args.enroll or args.enroll_address or args.name is not None:
            _enroll(args)  # before any data or model is loaded: a refused token fails fast
    import torch

    if config.threads:
        torch.set_num_threads(config.threads)  # before any work: data loading and model init included
    if args.app:
        factory = load_object(args.app, key="app")
    else:
        from fedgrid.simulation.tasks import builtin_client

        factory = builtin_client
    options = _client_options(args, config)
    spec = _parallel_spec(config)
    client: Any
    if spec.nproc > 1 and torchrun_rank() is None:
        from fedgrid.client.parallel import ParallelClient

        client = ParallelClient(factory, (index, total, args.seed), options, spec=spec, threads=config.threads)
    else:
        client = factory(index, total, args.seed, **options)
    print(f"fedgrid client {index}/{total}: {torch.get_num_threads()} threads, torch {torch.__version__}"
          + (f", {spec.nproc} ranks ({config.parallel})" if spec.nproc > 1 else ""), flush=True)
    if args.region:
        client.region = args.region
    from fedgrid.capabilities import describe
    from fedgrid.client.capabilities import override_from

    client.capability_override = override_from(config)
    try:
        reported = client.capabilities()
    except ValueError as exc:  # an --app's own capabilities(): before run(), whose ValueErrors are TLS files
        raise ConfigError("app", f"the client's capabilities: {exc}") from None
    print(f"fedgrid client {index}/{total}: reports {describe(reported.device, reported.num_accelerators, reported.memory_bytes)} "
          "at join", flush=True)
    state_path = Path(args.state_dir) / f"client-{index}.pt" if args.state_dir else None

    def interrupt(signal_name: str) -> None:
        raise KeyboardInterrupt(signal_name)  # unwinds run(), which tells the coordinator it leaves

    on_task, on_event, http = None, None, None
    if (args.http or args.http_token_file) and (rank is None or rank[0] == 0):
        from fedgrid.client.monitor import serve_client_metrics

        if not args.http:
            raise ConfigError("http_token_file", "goes with --http (the address of the client's metrics)")
        monitor, http = serve_client_metrics(args.http, token_file=args.http_token_file, name=client.name, coordinator=args.coordinator)
        on_task, on_event = monitor.on_task, monitor.on_event
        print(f"fedgrid client {index}/{total}: metrics on http://{http.address}/metrics, status on http://{http.address}/api/status"
              f"{' (bearer token required)' if http.authenticated else ''}", flush=True)
    timeout = {} if args.connect_timeout_s is None else {"connect_timeout": args.connect_timeout_s}

    def serve_tasks(member: Any) -> Any:
        return run(member, coordinator=args.coordinator, state_path=state_path, ca=args.ca, cert=args.cert, key=args.key,
                   server_name=args.server_name, on_task=on_task, on_event=on_event, **timeout)

    try:
        with GracefulStop(interrupt, what="client"):
            if torchrun_rank() is not None:  # rank 0 serves the coordinator's tasks, the other ranks rank 0's
                from fedgrid.client.parallel import serve_torchrun

                summary = serve_torchrun(client, spec, serve_tasks)
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
        raise ConfigError("cert", str(exc)) from None  # TLS files incomplete or unreadable (the message names the file)
    finally:
        if http is not None:
            http.stop()
        if hasattr(client, "close"):
            client.close()  # a ParallelClient's workers
    print(f"client {client.name}: {summary.rounds} rounds trained; run finished")
    return 0


#: Where ``fedgrid client`` finds an enrollment token that is not on its command line.
ENROLL_TOKEN_ENV = "FEDGRID_ENROLL_TOKEN"
#: Longest token file read (a token is about 60 characters).
MAX_TOKEN_FILE_BYTES = 4096


def _enroll_token(args: argparse.Namespace) -> str:
    """The enrollment token: ``--enroll``, else ``--enroll-file``, else ``$FEDGRID_ENROLL_TOKEN``
    ("" for none). A token on the command line works, with a warning: other local users can read
    it in ``ps`` until it is spent."""
    if args.enroll and args.enroll_file:
        raise ConfigError("enroll", "give the token once: --enroll TOKEN or --enroll-file FILE, not both")
    if args.enroll:
        print("fedgrid client: warning: the token on the command line is visible to other users of this machine "
              f"until it is spent; prefer --enroll-file FILE or ${ENROLL_TOKEN_ENV}", file=sys.stderr)
        return str(args.enroll)
    if args.enroll_file:
        try:
            with open(args.enroll_file, "rb") as f:
                data = f.read(MAX_TOKEN_FILE_BYTES + 1)
        except OSError as exc:
            raise ConfigError("enroll_file", f"cannot read {args.enroll_file}: {exc.strerror}") from None
        if len(data) > MAX_TOKEN_FILE_BYTES:
            raise ConfigError("enroll_file", f"{args.enroll_file} is over {MAX_TOKEN_FILE_BYTES} bytes: not a token file")
        token = data.decode("ascii", "replace").strip()
        if not token:
            raise ConfigError("enroll_file", f"{args.enroll_file} is empty")
        return token
    return os.environ.get(ENROLL_TOKEN_ENV, "").strip()


def _enroll(args: argparse.Namespace) -> None:
    """``fedgrid client --enroll``: the device's certificate, once (``fedgrid.client.enroll``)."""
    from fedgrid.client.enroll import enroll

    if not args.enroll:
        raise ConfigError("enroll", "--enroll-address and --name go with --enroll TOKEN, --enroll-file FILE or "
                          f"${ENROLL_TOKEN_ENV} (under mTLS the certificate names the client)")
    missing = [flag for flag, value in (("--enroll-address", args.enroll_address), ("--ca", args.ca), ("--cert", args.cert),
                                        ("--key", args.key)) if not value]
    if missing:
        raise ConfigError("enroll", f"--enroll needs {', '.join(missing)}: the enrollment service, the CA bundle that signs "
                          "the coordinator, and where this client's certificate and key go")
    try:
        identity = enroll(args.enroll_address, args.enroll, ca=args.ca, cert=args.cert, key=args.key,
                          server_name=args.server_name, name=args.name)
    except ValueError as exc:
        if isinstance(exc, FedgridError):  # PKIError: a file named in the message
            raise
        raise ConfigError("enroll" if args.name is None else "name", str(exc)) from None
    print(f"fedgrid client: identity {identity!r} (certificate {args.cert}, key {args.key})", flush=True)


def _status(args: argparse.Namespace) -> int:
    """``fedgrid status ADDRESS`` (``fedgrid.watch``): one line naming the address when it cannot connect."""
    from fedgrid.watch import StatusUnavailable, status_command

    try:
        return status_command(args.address, watch=args.watch, interval=args.interval, token_file=args.token_file)
    except StatusUnavailable as exc:
        print(f"fedgrid status: {exc}", file=sys.stderr)
        return 1


def _certs(args: argparse.Namespace) -> int:
    """``fedgrid certs ...``: bad input (an unknown name, an invalid identity, an existing CA)
    exits 2 with the problem named, like a bad flag."""
    from fedgrid import pki

    d = args.dir
    try:
        if args.certs_command == "init":
            path = pki.init_ca(d, name=args.name, days=args.days)
            print(f"CA {args.name!r} created: {path} (key {pki.CA_KEY}, 0600); revocation list {pki.CRL}")
        elif args.certs_command == "issue":
            cert, key = pki.issue(d, args.name, server=args.server, sans=args.san, days=args.days)
            print(f"{'server' if args.server else 'client'} certificate for {args.name!r}: {cert} (key {key}, 0600)")
        elif args.certs_command == "revoke":
            serials = pki.revoke(d, args.name)
            print(f"revoked {args.name!r} (serial {', '.join(f'{s:x}' for s in serials)}); {pki.CRL} rewritten")
        elif args.certs_command == "list":
            print(_certs_table(pki.list_certs(d)))
        elif args.certs_command == "token":
            expires = pki.parse_duration(args.expires)
            scope = f"for {args.name!r}" if args.name else "for any name"
            if args.out:
                token = _token_to_file(args.out, lambda: pki.issue_token(d, name=args.name, expires=expires))
                print(f"enrollment token {token.partition('.')[0]} {scope}, valid {args.expires}: written to {args.out} (0600)")
            else:
                token = pki.issue_token(d, name=args.name, expires=expires)
                print(f"enrollment token {token.partition('.')[0]} {scope}, valid {args.expires}; shown once:", file=sys.stderr)
                print(token)
        else:
            pki.revoke_token(d, args.token_id)
            print(f"enrollment token {args.token_id} revoked")
    except ValueError as exc:  # PKIError is one
        print(f"fedgrid certs {args.certs_command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _token_to_file(path: str, issue: Callable[[], str]) -> str:
    """``issue()``'s token, written to the new file ``path`` (mode 0600 from its creation). The
    file is made first, so a path that cannot be written spends no token; a failed issue
    leaves no file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ValueError(f"cannot create {path}: {exc.strerror} (the token file must be new)") from None
    try:
        token = issue()
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    except BaseException:
        os.unlink(path)
        raise
    return token


def _report(args: argparse.Namespace) -> int:
    """``fedgrid report``: a bad run directory exits 2 with the file (and line) named."""
    from fedgrid.report import ReportError, load_runs, write_report

    try:
        runs = load_runs(args.runs, args.label)
        import matplotlib  # noqa: F401 - the optional extra: a clear error before any file is written
    except ReportError as exc:
        print(f"fedgrid report: error: {exc}", file=sys.stderr)
        return 2
    except ImportError:
        print("fedgrid report: error: plotting needs matplotlib, which is not installed: pip install 'fedgrid[report]'", file=sys.stderr)
        return 2
    try:
        written, notes = write_report(runs, args.out)
    except OSError as exc:
        print(f"fedgrid report: error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"fedgrid report: {note}", file=sys.stderr)
    print(f"fedgrid report: {len(runs)} run(s); wrote {', '.join(str(p) for p in written)}")
    return 0


def _new(args: argparse.Namespace) -> int:
    from fedgrid.new_app import create_app

    folder = create_app(args.name)
    print(f"wrote {folder}/ ({', '.join(sorted(p.name for p in folder.iterdir()))}); run: fedgrid simulate --config {folder}/config.toml")
    return 0


def _certs_table(records: Sequence[Any]) -> str:
    rows = [("NAME", "KIND", "SERIAL", "NOT AFTER", "STATUS")]
    rows += [(r.name, r.kind, f"{r.serial:x}", r.not_after.strftime("%Y-%m-%d %H:%M:%SZ"), r.status()) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # simulate and certs print what they did; the services log what they do.
    quiet = args.command in ("simulate", "certs", "report", "new", "status", "health", "launch")
    level = logging.DEBUG if args.verbose else (logging.WARNING if quiet else logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return {"simulate": _simulate, "coordinator": _coordinator, "region": _region, "client": _client, "certs": _certs, "report": _report,
                "new": _new, "status": _status, "wan": wan_command, "health": health.command, "launch": launch.command}[args.command](args)
    except ConfigError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    except (FedgridError, OSError) as exc:  # an RPC that failed, a port taken, a file unreadable
        print(error_line(exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before a command installed its own handling (loading data, building a model)
        print(f"fedgrid {args.command}: interrupted", file=sys.stderr)
        return FORCED_EXIT_STATUS


if __name__ == "__main__":
    sys.exit(main())
