"""The command line's rough edges, filed down: no abbreviated flags, one line per round when
output is not a terminal, 128 + the signal after a stopped run, a coordinator that starts
with no flags on loopback."""

from __future__ import annotations

import signal

import pytest

from fedgrid import cli
from fedgrid.cli import simulate
from fedgrid.config import load_config
from fedgrid.errors import ConfigError
from fedgrid.interrupts import GracefulStop
from fedgrid.server.serve import Coordinator


@pytest.mark.parametrize(
    "flag, meant",
    [
        ("--local", "'--local-epochs'"),  # a prefix of one flag: argparse would take it silently
        ("--round", "'--rounds'"),
        ("--server", "'--server-lr'"),  # a prefix of several: argparse printed its whole usage
    ],
)
def test_a_flag_is_never_abbreviated(flag, meant, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["simulate", flag, "1"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.count("\n") == 1, err  # one line, not the usage
    assert err.startswith(f"fedgrid simulate: error: unrecognized arguments: {flag} (did you mean ")
    assert meant in err


def test_no_abbreviation_in_any_subcommand():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    assert parser.allow_abbrev is False
    assert [name for name, p in sub.items() if p.allow_abbrev] == []


def test_one_line_per_round_when_output_is_not_a_terminal(tmp_path, capsys):
    status = cli.main(
        ["simulate", "--rounds", "2", "--clients", "2", "--local-epochs", "1", "--threads", "1"]
        + ["--out", str(tmp_path / "run")]
    )
    out, err = capsys.readouterr()
    assert status == 0
    rounds = [line for line in (out + err).splitlines() if line.lstrip().startswith("round ")]
    assert [line.split()[1] for line in rounds] == ["1/2", "2/2"], out + err  # each round once
    assert all(" 2 clients ok, 0 failed " in line for line in rounds), rounds  # not "clients 2 ok 0 failed"


@pytest.mark.parametrize("command", ["simulate", "coordinator", "launch"])
def test_a_mistyped_flag_is_compared_without_its_dashes(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--round", "1"])
    err = capsys.readouterr().err
    assert "--round (did you mean '--rounds'" in err, err
    assert "'--out'" not in err, err  # every flag shares "--": compared with it, --out was "close"


def _stopped_by(sig: signal.Signals):
    def run(args) -> int:  # a command whose run a signal stops gracefully, and which returns 0
        with GracefulStop(lambda name: None, what=args.command):
            signal.raise_signal(sig)
        return 0

    return run


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_run_a_signal_stopped_exits_128_plus_the_signal(sig, status, monkeypatch):
    monkeypatch.setattr(simulate, "run", _stopped_by(sig))
    assert cli.main(["simulate"]) == status
    monkeypatch.setattr(simulate, "run", lambda args: 0)
    assert cli.main(["simulate"]) == 0  # the next command in this process starts afresh


def test_coordinator_serves_loopback_with_no_flags_and_nothing_else_without_certificates():
    listen = load_config().listen
    assert listen == "127.0.0.1:50051"
    credentials, check = Coordinator._security(listen.rpartition(":")[0], None, False)
    assert credentials is None and not check.tls  # plaintext, for development, on loopback only
    for host in ("0.0.0.0", "10.1.2.3", "[::]"):
        with pytest.raises(ConfigError, match="needs --ca, --cert and --key") as info:
            Coordinator._security(host, None, False)
        assert info.value.key == "listen"


def test_a_new_apps_header_names_the_app_not_a_partition_it_does_not_use(tmp_path, monkeypatch, capsys):
    """A `fedgrid new` app splits its data itself (data.py: IID): the header said `partition
    dirichlet:0.5`, the built-in clients' default, which the app never sees."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["new", "headerapp"]) == 0
    argv = [
        "simulate",
        "--config",
        "headerapp/config.toml",
        "--rounds",
        "1",
        "--threads",
        "1",
        "--out",
        "run",
    ]
    assert cli.main(argv) == 0
    header = [line for line in capsys.readouterr().out.splitlines() if line.startswith("fedgrid simulate:")]
    assert header[0].startswith(
        "fedgrid simulate: 3 clients, 1 rounds, app headerapp.app:client (its own data and split), "
        "model headerapp.app:model, engine "
    )
    assert "partition" not in header[0] and "dataset" not in header[0]
