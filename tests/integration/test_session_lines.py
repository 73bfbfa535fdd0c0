"""The embedding session is heard while it trains: a line at the join and one per task, on
stderr when the host program configured no logging (where Python drops INFO records), at
INFO of ``fedgrid.client.session`` when it did, and none with ``verbose=False``."""

from __future__ import annotations

import logging

from fedgrid.client import FitOutput, connect

from harness import InProcessCoordinator

EXAMPLES = 40


def _one_round(coordinator: InProcessCoordinator, **options) -> None:  # type: ignore[no-untyped-def]
    with connect(coordinator.address, name="host", num_examples=EXAMPLES, **options) as session:
        coordinator.open_round()
        for task in session.tasks():
            session.submit(FitOutput(task.state, num_examples=EXAMPLES, metrics={"loss": 0.5}))
            break
        outcome = coordinator.wait_round()
    assert len(outcome.results) == 1


def _unconfigured_logging(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A host program that never configured logging: pytest's capture handlers, which it adds to
    the root logger for each test phase, put aside (inside the test's call)."""
    monkeypatch.setattr(logging.root, "handlers", [])


def test_a_line_per_task_on_stderr_when_logging_is_not_configured(coordinator, monkeypatch, capfd):
    _unconfigured_logging(monkeypatch)
    _one_round(coordinator)
    lines = capfd.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in lines] == ["fedgrid session", "fedgrid session"], lines
    assert lines[0].startswith(f"fedgrid session: joined {coordinator.address} as ")
    assert lines[0].endswith(", plaintext)")  # which coordinator and run, and that nothing protects it
    assert lines[1].startswith(
        f"fedgrid session: round 1: fit result sent ({EXAMPLES} examples, loss 0.5000; "
    )
    assert " kB down, " in lines[1] and lines[1].endswith(" kB up)")


def test_verbose_false_keeps_the_session_silent(coordinator, monkeypatch, capfd):
    _unconfigured_logging(monkeypatch)
    _one_round(coordinator, verbose=False)
    assert capfd.readouterr().err == ""


def test_configured_logging_gets_the_lines_at_info(coordinator, caplog, capfd):
    with caplog.at_level(logging.INFO, logger="fedgrid.client.session"):
        _one_round(coordinator)
    lines = [r.getMessage() for r in caplog.records if r.name == "fedgrid.client.session"]
    assert len(lines) == 2 and lines[1].startswith("round 1: fit result sent (40 examples, loss 0.5000; ")
    assert "fedgrid session:" not in capfd.readouterr().err  # the program's logging, not a second copy


def test_leaving_a_vanished_coordinator_is_one_line(coordinator, caplog):
    caplog.set_level(logging.INFO, logger="fedgrid")
    with connect(coordinator.address, name="host", num_examples=EXAMPLES):
        coordinator.stop()  # the coordinator vanishes while the client is joined; the exit sends Leave
    [line] = [r.getMessage() for r in caplog.records if "leaves" in r.getMessage()]
    assert "\n" not in line and "_InactiveRpcError" not in line and "debug_error_string" not in line, line
    assert line.startswith("could not tell the coordinator that this client leaves: UNAVAILABLE: ")
