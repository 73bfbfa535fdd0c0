"""A finished coordinator keeps its status server up until the watching status page has read the
final state (``http_linger_s``, ``FinalStateHold``), and an unwatched one exits at once: ``fedgrid
coordinator``'s ``serve`` in a thread with ``--http`` on port 0 and one client, over gRPC. The
coordinator's fleet runs on a ``ManualClock`` (``tests/support/clocked.py``): the hold's 120 s
pass only when the test moves the clock."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from fedgrid.cli import serve
from fedgrid.client import start_client
from fedgrid.clock import ManualClock
from fedgrid.config import load_config
from fedgrid.events import Event

from harness import THREADS, wait_until
from harness_clients import Named

HOLDING = "run finished: serving its final state on http://"


def _status(address: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{address}/api/status", timeout=10) as reply:
        assert reply.status == 200
        return json.loads(reply.read())


def _held(clock: ManualClock) -> None:
    """Returns once the hold sleeps on ``clock`` until its ``http_linger_s`` (120 s from 0)."""
    wait_until(lambda: 120.0 in clock.deadlines(), timeout=30, what="the hold asleep on the clock")


def _run(
    out: Path, on_event, clock: ManualClock, **overrides: Any
) -> tuple[threading.Thread, dict[str, Any]]:  # type: ignore[no-untyped-def]
    config = load_config(
        overrides={
            "listen": "127.0.0.1:0",
            "http": "127.0.0.1:0",
            "out": str(out),
            "rounds": 2,
            "min_clients": 1,
            "threads": THREADS,
            "seed": 0,
            **overrides,
        }
    )
    result: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: result.setdefault("final", serve(config, on_event=on_event, clock=clock)), daemon=True
    )
    thread.start()
    wait_until(lambda: (out / "address").exists(), timeout=60, what="the coordinator's address")
    handle = start_client(Named("w"), (out / "address").read_text().strip())
    result["client"] = handle
    return thread, result


def test_a_watched_run_serves_its_final_state_until_it_is_read(tmp_path, capsys):
    out = tmp_path / "run"
    seen: list[dict[str, Any]] = []

    def on_event(e: Event) -> None:
        if e.event == "round_committed" and e["round"] == 1:  # the page polls during the run
            seen.append(_status((out / "http_address").read_text().strip()))

    clock = ManualClock()
    thread, result = _run(out, on_event, clock, http_linger_s=120.0)
    printed: list[str] = []

    def holding() -> bool:
        printed.append(capsys.readouterr().out)
        return HOLDING in "".join(printed)

    wait_until(holding, timeout=120, what="the coordinator to hold its final state")
    assert thread.is_alive()  # the run is over, the server still up: waiting for the page
    _held(clock)  # the hold waits on the fleet's clock, whose 120 s never pass here
    final = _status((out / "http_address").read_text().strip())  # the page's next poll
    thread.join(timeout=30)
    assert not thread.is_alive() and clock.now() == 0.0  # ended by the read, not the 120 s
    assert result["client"].join(timeout=30).rounds == 2
    assert [(s["state"], s["committed"]) for s in seen] == [("running", 1)]
    assert (final["state"], final["committed"], final["round"], final["rounds"]) == ("finished", 2, 2, 2)
    assert [h["round"] for h in final["history"]] == [1, 2]
    line = next(x for x in "".join(printed).splitlines() if x.startswith(HOLDING))
    assert line.endswith("until the status page reads it (at most 120 s, http_linger_s)")


def test_a_watcher_that_stops_reading_is_held_for_http_linger_s_of_the_clock(tmp_path, capsys):
    out = tmp_path / "run"

    def on_event(e: Event) -> None:
        if e.event == "round_committed" and e["round"] == 1:  # read once, during the run
            _status((out / "http_address").read_text().strip())

    clock = ManualClock()
    thread, result = _run(out, on_event, clock, http_linger_s=120.0)
    wait_until(lambda: HOLDING in capsys.readouterr().out, timeout=120, what="the hold of the final state")
    _held(clock)
    assert thread.is_alive()
    clock.advance(120.0)
    thread.join(timeout=30)
    assert not thread.is_alive() and result["final"] is not None  # the 120 s passed: stopped
    assert result["client"].join(timeout=30).rounds == 2


def test_an_unwatched_run_stops_its_status_server_at_once(tmp_path, capsys):
    out = tmp_path / "run"
    clock = ManualClock()
    thread, result = _run(out, None, clock, http_linger_s=120.0)
    thread.join(timeout=60)  # nobody read /api/status: no hold (the clock never moves)
    assert not thread.is_alive() and result["final"] is not None
    assert HOLDING not in capsys.readouterr().out
    address = (out / "http_address").read_text().strip()
    try:
        _status(address)
    except urllib.error.URLError as exc:
        assert isinstance(exc.reason, ConnectionRefusedError), exc
    else:
        raise AssertionError("the status server still answers after the coordinator returned")
