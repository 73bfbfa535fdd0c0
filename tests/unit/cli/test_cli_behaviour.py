"""The command line behaves: errors name the fix in one line, help says what flags do, a
stopped run keeps its committed model, user modules import from the current directory."""

from __future__ import annotations

import logging
import sys
import threading
from collections import OrderedDict
from datetime import timedelta

import pytest
import torch

from fedgrid import cli
from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.aggregation.selection import Sampling
from fedgrid.cli.client import client_config, client_options
from fedgrid.cli.support import config_from
from fedgrid.client.runtime import Connection, check_target
from fedgrid.errors import ConfigError
from fedgrid.fleet.base import Fleet, RoundOutcome
from fedgrid.plugins import load_object
from fedgrid.runlog import RunWriter, load_model
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import RunIO, Schedule
from fedgrid.types import ClientInfo, FitRes

CLIENTS = [ClientInfo(client_id="c0", name="n0")]


def test_version_comes_from_the_package_metadata(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"fedgrid {version('fedgrid')}\n"


def test_mistyped_flag_suggests_the_flag_meant_in_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["simulate", "--roundz", "3"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert (
        err == "fedgrid simulate: error: unrecognized arguments: --roundz (did you mean '--rounds'?) 3 "
        "(all flags: fedgrid simulate --help)\n"
    )


def test_help_shows_each_command_its_own_flags_and_says_what_they_do():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    coordinator = {s for a in sub["coordinator"]._actions for s in a.option_strings}
    assert (
        not {"--engine", "--dropout-prob", "--progress", "--speed", "--clients", "--batch-clients"}
        & coordinator
    )
    assert {"--listen", "--min-clients", "--rounds", "--state-dir"} <= coordinator
    client = {a.dest: a for a in sub["client"]._actions}
    for dest in ("coordinator", "seed", "region", "config", "connect_timeout_s"):
        assert client[dest].help, dest


@pytest.mark.parametrize(
    "target, words",
    [
        ("localhost", "'localhost' has no port: expected HOST:PORT"),
        ("localhost:", "'localhost:' has port '': expected HOST:PORT with a port in 1..65535"),
        ("10.0.0.1:99999", "has port '99999'"),
        ("10.0.0.1:0", "has port '0'"),
        ("::1", "has no port"),
    ],
)
def test_a_coordinator_address_without_a_good_port_is_refused(target, words, capsys):
    with pytest.raises(ValueError, match=words):
        check_target(target)
    with pytest.raises(ValueError, match=words):
        Connection(target)
    assert cli.main(["client", "--coordinator", target]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("fedgrid: error: config key 'coordinator': coordinator address ")
        and err.count("\n") == 1
    )


@pytest.mark.parametrize(
    "target, words",
    [
        ("http://127.0.0.1:50051", "starts with a scheme 'http://': expected HOST:PORT"),
        ("dns:///coord.example.org:443", "starts with a scheme 'dns://'"),
        ("unix:/run/fedgrid.sock", "starts with a scheme 'unix:'"),
        ("coord/x:50051", "has host 'coord/x', not a host name or IP address"),
        ("::1:50051", "has host '::1', not a host name or IP address"),
    ],
)
def test_a_malformed_coordinator_address_is_refused_at_once(target, words, capsys):
    # gRPC would look such a name up and retry it until the connect deadline (60 s).
    with pytest.raises(ValueError, match=words):
        Connection(target)
    assert cli.main(["client", "--coordinator", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedgrid: error: config key 'coordinator': coordinator address ") and words in err


@pytest.mark.parametrize("flag", ["--give-up-after-s", "--connect-timeout-s"])
def test_a_bound_that_is_not_positive_seconds_is_refused(flag, capsys):
    assert cli.main(["client", "--coordinator", "127.0.0.1:9", flag, "0"]) == 2
    assert "must be a positive number of seconds, got 0.0" in capsys.readouterr().err


def test_good_addresses_pass():
    good = ("localhost:50051", "[::1]:1", "10.0.0.1:65535", "coord.example.org:443", "site_1:50051")
    assert [check_target(t) for t in good] == list(good)


def test_client_takes_its_keys_from_the_config_file_flags_winning(tmp_path, monkeypatch):
    seen = {}

    def fake_run(client, *, coordinator, **options):
        seen.update(options, threads=torch.get_num_threads(), client=client)
        from fedgrid.client.runtime import RunSummary

        return RunSummary(client_id="c", rounds=0)

    monkeypatch.setattr("fedgrid.client.runtime.run_client", fake_run)
    config = tmp_path / "run.toml"
    # A file shared with the coordinator: its other keys are checked and left alone.
    config.write_text(
        'rounds = 7\nmin_clients = 3\ndataset = "synthetic"\nbatch_size = 5\nlr = 0.25\nthreads = 2\n'
    )
    threads = torch.get_num_threads()
    try:
        assert (
            cli.main(
                [
                    "client",
                    "--config",
                    str(config),
                    "--coordinator",
                    "127.0.0.1:9",
                    "--lr",
                    "0.5",
                    "--connect-timeout-s",
                    "7",
                    "--give-up-after-s",
                    "30",
                ]
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    assert seen["threads"] == 2 and seen["connect_timeout"] == 7.0 and seen["retry_max_elapsed"] == 30.0
    args = cli.build_parser().parse_args(
        ["client", "--config", str(config), "--coordinator", "h:1", "--lr", "0.5"]
    )
    options = client_options(args, client_config(args))["options"]
    assert (options.dataset, options.batch_size, options.lr) == ("synthetic", 5, 0.5)
    config.write_text('optimizer = "lbfgs"\n')
    with pytest.raises(ConfigError) as info:
        client_options(args, client_config(args))
    assert info.value.key == "optimizer"


def test_client_reports_what_its_file_and_flags_state_at_join(tmp_path, monkeypatch, capsys):
    from fedgrid.capabilities import Capabilities

    seen = {}

    def fake_run(client, *, coordinator, **options):
        seen["reported"] = client.capabilities()  # what Connection.join sends
        from fedgrid.client.runtime import RunSummary

        return RunSummary(client_id="c", rounds=0)

    monkeypatch.setattr("fedgrid.client.runtime.run_client", fake_run)
    config = tmp_path / "run.toml"
    config.write_text(
        'dataset = "synthetic"\nreport_device = "cuda"\nreport_memory = "8GiB"\nrequire_device = "cuda"\n'
    )
    assert (
        cli.main(
            [
                "client",
                "--config",
                str(config),
                "--coordinator",
                "127.0.0.1:9",
                "--report-accelerators",
                "2",
                "--report-memory",
                "40GiB",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    assert seen["reported"] == Capabilities("cuda", 2, 40 << 30)  # the flag wins over the file
    assert "fedgrid client 0/1: reports cuda x2, 40.0 GiB memory at join" in capsys.readouterr().out


def test_a_replaced_client_exits_with_one_line_naming_its_identity(tmp_path, monkeypatch, capsys):
    import grpc

    from fedgrid.client import IdentityConflict

    def fake_run(client, *, coordinator, **options):
        raise IdentityConflict("PollTask", grpc.StatusCode.UNAUTHENTICATED, "session replaced", client.name)

    monkeypatch.setattr("fedgrid.client.runtime.run_client", fake_run)
    config = tmp_path / "run.toml"
    config.write_text('dataset = "synthetic"\n')
    argv = ["client", "--config", str(config), "--coordinator", "127.0.0.1:9", "--partition", "0/2"]
    assert cli.main([*argv, "--threads", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedgrid: error: identity '")
    assert "is taken: another process joined the coordinator as" in err
    assert "Two processes with the same --partition or the same certificate?" in err


def test_a_bad_report_flag_stops_the_client_in_one_line_and_is_no_coordinator_flag(capsys):
    assert cli.main(["client", "--coordinator", "127.0.0.1:9", "--report-memory", "lots"]) == 2
    err = capsys.readouterr().err
    assert (
        "config key 'report_memory': 'lots' is not a size (e.g. 16GiB, 512MB or a byte count)" in err
        and err.count("\n") == 1
    )
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["coordinator", "--report-memory", "8GiB"])
    assert (
        cli.build_parser().parse_args(["coordinator", "--min-client-memory", "8GiB"]).min_client_memory
        == "8GiB"
    )


def test_client_tls_files_from_the_config_file(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('ca = "ca.pem"\ncert = "c.pem"\nkey = "c.key"\n')
    args = cli.build_parser().parse_args(
        ["client", "--config", str(config), "--coordinator", "h:1", "--key", "other.key"]
    )
    loaded = client_config(args)
    assert (loaded.ca, loaded.cert, loaded.key) == ("ca.pem", "c.pem", "other.key")


def test_out_in_the_config_file_wins_over_the_default_run_directory(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f'out = "{tmp_path / "mine"}"\n')
    args = cli.build_parser().parse_args(["simulate", "--config", str(config)])
    assert config_from(args, cli.SIMULATE_KEYS).out == str(tmp_path / "mine")
    args = cli.build_parser().parse_args(["simulate", "--config", str(config), "--out", "flag"])
    assert config_from(args, cli.SIMULATE_KEYS).out == "flag"
    args = cli.build_parser().parse_args(["simulate"])
    assert config_from(args, cli.SIMULATE_KEYS).out.startswith("runs/simulate-")


def test_simulate_header_names_the_engine_auto_chose(tmp_path, capsys):
    assert (
        cli.main(
            [
                "simulate",
                "--rounds",
                "1",
                "--clients",
                "2",
                "--local-epochs",
                "1",
                "--progress",
                "false",
                "--threads",
                "1",
                "--out",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("fedgrid simulate: 2 clients, 1 rounds")
    assert ", engine sequential (" in header or ", engine batched (" in header


# -- user modules -------------------------------------------------------------------------
def test_app_module_in_the_current_directory_imports(tmp_path, monkeypatch):
    (tmp_path / "myapp_cwd.py").write_text("def make(*args):\n    return 42\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_object("myapp_cwd:make", key="app")() == 42


def test_import_failure_names_the_module_where_and_why(tmp_path, monkeypatch):
    (tmp_path / "broken_app.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_object("broken_app:make", key="app")
    text = str(info.value)
    assert info.value.key == "app"
    assert (
        f"importing 'broken_app' ({tmp_path / 'broken_app.py'}) failed: ModuleNotFoundError: "
        "No module named 'no_such_dependency_xyz'" in text
    )
    with pytest.raises(ConfigError) as info:
        load_object("absent_app_xyz:make", key="app")
    assert f"no module 'absent_app_xyz' in the current directory ({tmp_path})" in str(info.value)


# -- a stopped run ------------------------------------------------------------------------
class _OneClient(Fleet):
    """Each fit returns the global model plus one; ``stop_in_evaluate`` stops the engine
    while round 2 evaluates, after its fit was aggregated."""

    def __init__(self) -> None:
        self.engine: RoundEngine | None = None
        self.stop_in_evaluate = False

    def wait_for_clients(self, *, min_clients, timeout):
        return CLIENTS

    def fit_round(self, *, server_round, global_state, assignments, timeout, target=None):
        state = OrderedDict((k, v + 1) for k, v in global_state.items())
        return RoundOutcome([FitRes(CLIENTS[0], state, 1, {})], [])

    def evaluate_round(self, *, server_round, global_state, assignments, timeout):
        if self.stop_in_evaluate and server_round == 2:
            assert self.engine is not None
            self.engine.stop()
        return RoundOutcome([], [])

    def message_round(self, *, server_round, phase, assignments, timeout):
        raise AssertionError("no message phases")


def _engine(tmp_path, fleet, **io):
    strategy = FedAvg(sampling=Sampling(fraction_evaluate=1.0))
    strategy.initialize(initial_state=OrderedDict(w=torch.zeros(2)))
    engine = RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=5, min_clients=1, round_timeout=timedelta(seconds=1), join_timeout=timedelta(seconds=1)
        ),
        io=RunIO(writer=RunWriter(tmp_path / "run", {}), **io),
    )
    fleet.engine = engine
    return engine


def test_stop_after_the_current_round_keeps_its_model(tmp_path):
    stop = threading.Event()
    fleet = _OneClient()
    engine = _engine(tmp_path, fleet, stop=stop, on_round=lambda m: stop.set() if m.round == 2 else None)
    assert engine.run() is None
    assert [m.round for m in engine.history] == [1, 2]
    assert torch.equal(load_model(tmp_path / "run" / "model.safetensors")["w"], torch.full((2,), 2.0))


def test_stop_mid_round_writes_the_committed_model_not_the_half_done_one(tmp_path):
    fleet = _OneClient()
    fleet.stop_in_evaluate = True
    engine = _engine(tmp_path, fleet)
    assert engine.run() is None
    assert [m.round for m in engine.history] == [1]
    # round 2's fit had aggregated (w = 2) when it was abandoned: round 1's model (w = 1) is the one kept
    assert torch.equal(engine.strategy.global_state["w"], torch.ones(2))
    assert torch.equal(load_model(tmp_path / "run" / "model.safetensors")["w"], torch.ones(2))


def test_waiting_coordinator_says_what_it_waits_for(caplog):
    from fedgrid.clock import ManualClock
    from fedgrid.server import remote_fleet

    from clocked import run_out

    clock = ManualClock()
    fleet = remote_fleet.RemoteFleet(heartbeat_interval=timedelta(seconds=60), clock=clock)
    timeout = 4.5 * remote_fleet.WAITING_REPORT_S
    try:
        with caplog.at_level(logging.INFO, logger="fedgrid.server.remote_fleet"), pytest.raises(TimeoutError):
            run_out(clock, lambda: fleet.wait_for_clients(min_clients=2, timeout=timedelta(seconds=timeout)))
    finally:
        fleet.close()
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting")]
    # At 0 and every WAITING_REPORT_S after it, until the timeout: 0, 10, 20, 30 and 40 s.
    assert waiting == ["waiting for 2 clients (0 joined)"] * 5 and clock.now() == timeout


def test_rpc_and_tls_errors_are_one_line(tmp_path, capsys):
    import grpc

    from fedgrid.cli.support import error_line
    from fedgrid.client.runtime import RpcFailed

    failed = RpcFailed(
        "Join", grpc.StatusCode.UNAVAILABLE, "failed to connect\n  debug_error_string = {...}\n"
    )
    assert (
        error_line(failed)
        == "fedgrid: error: Join failed: UNAVAILABLE: failed to connect debug_error_string = {...}"
    )
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    threads = torch.get_num_threads()
    try:
        code = cli.main(
            [
                "client",
                "--coordinator",
                "127.0.0.1:9",
                "--ca",
                str(bad),
                "--cert",
                str(bad),
                "--key",
                str(bad),
                "--threads",
                "1",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert (
        code == 2
        and err.count("\n") == 1
        and err.startswith(f"fedgrid: error: config key 'cert': certificate {bad}: ")
    )
