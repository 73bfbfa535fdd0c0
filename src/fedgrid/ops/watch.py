"""``fedgrid status ADDRESS``: a running coordinator's round, progress and clients in the terminal.

It reads the coordinator's ``/api/status`` (``fedgrid coordinator --http HOST:PORT``) and
draws it with ``rich``; ``--watch`` redraws it every ``--interval`` seconds until Ctrl-C.
Names and regions are client text: they are shown as plain ``rich.text.Text`` (never parsed
as rich markup) with non-printable characters replaced, so a client cannot restyle or
move the cursor of an operator's terminal.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any, Mapping

from fedgrid.capabilities import describe
from fedgrid.errors import FedgridError

__all__ = ["fetch_status", "render_status", "status_command", "StatusUnavailable", "FETCH_TIMEOUT_S"]

#: Deadline of one ``/api/status`` request.
FETCH_TIMEOUT_S = 5.0


class StatusUnavailable(FedgridError):
    """The status endpoint could not be read (the message names the address)."""


def _url(address: str) -> str:
    base = address if address.startswith(("http://", "https://")) else f"http://{address}"
    return base.rstrip("/") + "/api/status"


def fetch_status(
    address: str, *, token: str | None = None, timeout: float = FETCH_TIMEOUT_S
) -> dict[str, Any]:
    """The JSON of ``ADDRESS/api/status``.

    Raises:
        StatusUnavailable: no connection, an HTTP error or a reply that is not the status JSON.
    """
    url = _url(address)
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310 - http(s) only, built above
            data = json.loads(reply.read(16 * 1024 * 1024))
    except urllib.error.HTTPError as exc:
        hint = " (pass --token-file)" if exc.code == 401 else ""
        raise StatusUnavailable(f"cannot read {url}: HTTP {exc.code} {exc.reason}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatusUnavailable(f"cannot connect to {address} ({url}): {reason}") from None
    except ValueError as exc:
        raise StatusUnavailable(f"{url} did not answer JSON: {exc}") from None
    if not isinstance(data, dict) or "clients" not in data or "round" not in data:
        raise StatusUnavailable(
            f"{url} did not answer a fedgrid status (is {address} a coordinator's --http address?)"
        )
    return data


def _plain(value: object) -> Any:
    from rich.text import Text

    return Text("".join(ch if ch.isprintable() else "\N{REPLACEMENT CHARACTER}" for ch in str(value)))


def _device(client: Mapping[str, Any]) -> str:
    """``cuda x2, 80.0 GiB memory``: a client's device type, accelerators and memory (what a coordinator
    older than these fields leaves out, left out)."""
    return describe(
        str(client.get("device", "")),
        int(client.get("accelerators") or 0),
        int(client.get("memory_bytes") or 0),
    )


def render_status(status: Mapping[str, Any]) -> Any:
    """A ``rich`` renderable of ``status`` (the JSON of ``/api/status``)."""
    from rich.console import Group
    from rich.table import Table

    head = Table.grid(padding=(0, 2))
    head.add_row(
        "run",
        _plain(status.get("run_id", "")),
        "state",
        _plain(f"{status.get('state')} / {status.get('phase')}"),
    )
    head.add_row(
        "round",
        _plain(f"{status.get('round')} / {status.get('rounds')}"),
        "committed",
        _plain(status.get("committed", 0)),
    )
    p = status.get("progress")
    if p:
        done = f"{p['results']} of {p['expected']} results, {p['failures']} failed" + (
            " (closed)" if p.get("closed") else ""
        )
        head.add_row("phase", _plain(p["phase"]), "progress", _plain(done))
    history = status.get("history") or []
    if history:
        last = history[-1]
        acc = "-" if last.get("accuracy") is None else f"{last['accuracy']:.4f}"
        loss = "-" if last.get("loss") is None else f"{last['loss']:.4f}"
        head.add_row("last round", _plain(last["round"]), "accuracy / loss", _plain(f"{acc} / {loss}"))
    clients = Table(
        title=f"{status.get('clients_total', len(status['clients']))} clients", title_justify="left"
    )
    for column in ("name", "region", "state", "device", "last seen", "id"):
        clients.add_column(column)
    for c in status["clients"]:
        clients.add_row(
            _plain(c.get("name", "")),
            _plain(c.get("region", "")),
            _plain(c.get("state", "")),
            _plain(_device(c)),
            _plain(f"{float(c.get('last_seen_s', 0)):.1f}s ago"),
            _plain(c.get("id", "")),
        )
    return Group(head, clients)


def status_command(address: str, *, watch: bool = False, interval: float = 2.0, token_file: str = "") -> int:
    """``fedgrid status``: prints the view once, or redraws it until Ctrl-C with ``watch``.

    Raises:
        StatusUnavailable: the first read failed (a later one, while watching, is shown in place).
        ConfigError: an unreadable token file.
    """
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    from fedgrid.webserve import read_token

    token = read_token(token_file, key="token_file") if token_file else None
    console = Console()
    status = fetch_status(address, token=token)
    if not watch:
        console.print(render_status(status))
        return 0
    try:
        with Live(render_status(status), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)  # the refresh period of a display, not a synchronization
                try:
                    view: Any = render_status(fetch_status(address, token=token))
                except StatusUnavailable as exc:
                    view = Text(str(exc), style="red")
                live.update(view, refresh=True)
    except KeyboardInterrupt:
        return 0
