"""``fedgrid CMD``: the parser is built for the command run (its module alone is imported), and
the whole parser answers everything else; the lazily re-exported names still resolve.
tests/e2e/test_import_cost.py checks, in fresh interpreters, what that spares."""

from __future__ import annotations

import argparse

import pytest

from fedgrid import cli
from fedgrid.cli import support


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(sub.choices)


def test_the_parser_holds_every_command_or_the_one_run():
    assert _commands(cli.build_parser()) == list(cli.COMMANDS)
    assert _commands(cli.build_parser("certs")) == ["certs"]
    assert cli._command_named(["-v", "certs", "init", "--dir", "x"]) == "certs"
    assert cli._command_named(["status", "coordinator:8080"]) == "status"  # the command, not an argument
    for argv in ([], ["--help"], ["--version"], ["cert", "init"], ["-v"]):
        assert cli._command_named(argv) is None  # the whole parser: usage, version, the choices


def test_a_command_runs_with_its_own_parser_and_the_top_level_flags(tmp_path, capsys):
    assert cli.main(["-v", "certs", "init", "--dir", str(tmp_path / "ca"), "--name", "unit CA"]) == 0
    assert capsys.readouterr().out.startswith(f"CA 'unit CA' created: {tmp_path / 'ca' / 'ca.pem'}")


def test_a_misspelt_command_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["cert", "init"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "invalid choice: 'cert'" in err and "'certs'" in err


def test_a_mistyped_flag_of_a_light_command_is_still_named(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["health", "127.0.0.1:1", "--timout", "3"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "unrecognized arguments: --timout (did you mean '--timeout'?) 3" in err


def test_the_lazy_names_resolve_to_the_modules_objects():
    from fedgrid.cli.coordinator import serve
    from fedgrid.cli.simulate import SimulateProgress

    assert cli.serve is serve and cli.SimulateProgress is SimulateProgress
    assert cli.SIMULATE_KEYS is support.SIMULATE_KEYS and "rounds" in cli.SIMULATE_KEYS
    assert "regional_rounds" in support.REGION_KEYS and "rounds" not in support.REGION_KEYS
    assert "rounds" in support.COORDINATOR_KEYS and "partition" in support.CLIENT_CONFIG_KEYS
    assert set(cli.__all__) <= set(dir(cli))
    with pytest.raises(AttributeError, match="has no attribute 'NO_SUCH_KEYS'"):
        support.NO_SUCH_KEYS  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        cli.nothing  # noqa: B018
