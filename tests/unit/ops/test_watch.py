"""``fedgrid status``'s view: a coordinator's status drawn with rich, client text shown as text."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from fedgrid.ops.watch import StatusUnavailable, fetch_status, render_status

STATUS = {
    "run_id": "r1",
    "state": "running",
    "phase": "fit",
    "round": 2,
    "rounds": 5,
    "committed": 1,
    "progress": {"round": 2, "phase": "fit", "results": 1, "failures": 0, "expected": 2, "closed": False},
    "clients_total": 2,
    "clients": [
        {
            "id": "a1",
            "name": "[bold red]fake[/] \x1b[2J",
            "region": "eu",
            "state": "training",
            "last_seen_s": 1.25,
            "device": "cuda",
            "accelerators": 2,
            "memory_bytes": 80 << 30,
        },
        {
            "id": "b2",
            "name": "plain",
            "region": "us",
            "state": "reported",
            "last_seen_s": 0.5,
        },  # an older coordinator's
    ],
    "history": [{"round": 1, "accuracy": 0.8125, "loss": 0.5, "bytes_up": 10, "bytes_down": 20}],
}


def _draw(status: dict) -> str:
    out = io.StringIO()
    Console(file=out, width=120, force_terminal=False, color_system=None).print(render_status(status))
    return out.getvalue()


def test_status_view_shows_round_progress_and_clients():
    text = _draw(STATUS)
    assert "2 / 5" in text and "1 of 2 results, 0 failed" in text and "0.8125 / 0.5000" in text
    assert "training" in text and "reported" in text and "1.2s ago" in text and "2 clients" in text
    assert "cuda x2, 80.0 GiB memory" in text


def test_client_text_is_not_markup_and_loses_control_characters():
    text = _draw(STATUS)
    assert "[bold red]fake[/]" in text  # shown literally, not as style
    assert "\x1b" not in text and "\N{REPLACEMENT CHARACTER}[2J" in text


def test_a_reply_that_is_not_a_status_is_refused(monkeypatch):
    import fedgrid.ops.watch as watch

    class Reply(io.BytesIO):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(watch.urllib.request, "urlopen", lambda request, timeout: Reply(b'{"hello": 1}'))
    with pytest.raises(StatusUnavailable, match="did not answer a fedgrid status"):
        fetch_status("127.0.0.1:1")
    monkeypatch.setattr(watch.urllib.request, "urlopen", lambda request, timeout: Reply(b"<html>"))
    with pytest.raises(StatusUnavailable, match="did not answer JSON"):
        fetch_status("127.0.0.1:1")
