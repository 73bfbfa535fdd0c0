"""``EventLog``: JSON lines on disk, in-process subscribers, escaped client text."""

from __future__ import annotations

import json

from fedgrid.events import EventLog, read_events


def test_events_go_to_the_file_and_subscribers_in_order(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    seen = []
    log.subscribe(seen.append)
    log.emit("round_opened", round=1, clients=3)
    log.emit("round_closed", round=1, reason="deadline", results=2, failures=1)
    lines = path.read_text().splitlines()  # flushed at once: readable before close
    assert [json.loads(line)["event"] for line in lines] == ["round_opened", "round_closed"]
    log.close()
    events = read_events(path)
    assert [(e.event, dict(e.fields)) for e in events] == [
        ("round_opened", {"round": 1, "clients": 3}),
        ("round_closed", {"round": 1, "reason": "deadline", "results": 2, "failures": 1}),
    ]
    assert [e.event for e in seen] == ["round_opened", "round_closed"] and seen[1]["reason"] == "deadline"
    assert events[0].t <= events[1].t


def test_client_text_cannot_forge_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    name = 'evil\n{"event": "round_committed", "round": 99}\x1b[2J'
    log.emit("client_joined", client="c1", name=name)
    log.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and "\x1b" not in lines[0]
    assert read_events(path)[0]["name"] == name  # escaped on disk, the same text read back


def test_a_failing_subscriber_does_not_stop_the_others(tmp_path):
    log = EventLog()
    seen = []

    def broken(event):
        raise RuntimeError("observer bug")

    log.subscribe(broken)
    log.subscribe(seen.append)
    log.emit("aggregating", round=2, updates=3, failures=0)
    assert [e["round"] for e in seen] == [2]


def test_a_restart_appends_and_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "events.jsonl"
    first = EventLog(path)
    first.emit("started", run_id="r", address="127.0.0.1:1", threads=1)
    first.close()
    with open(path, "a") as f:
        f.write('{"t": 1.0, "event": "upd')  # killed mid-write
    second = EventLog(path)
    second.emit("resumed", round=3)
    second.close()
    assert [e.event for e in read_events(path)] == ["started", "resumed"]
