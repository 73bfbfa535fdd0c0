"""A client's ``/api/status`` over real HTTP: during a round and after the run, against a real
coordinator (in process and as processes), behind the same token rule as the coordinator's.

"During a round" is read from inside the client's own ``fit`` of round 2: the client's
thread is then in the task, so what the status says is fixed, not raced.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from fedgrid.cli import serve
from fedgrid.client import start_client as start  # harness.start_client starts a process
from fedgrid.client.monitor import STATES, ClientMonitor, serve_client_metrics
from fedgrid.client.runtime import ClientEvent
from fedgrid.config import load_config
from fedgrid.errors import ConfigError
from fedgrid.simulation.tasks import builtin_client

from harness import THREADS, wait_until

ROUNDS = 3
FIELDS = {
    "name",
    "coordinator",
    "client_id",
    "run_id",
    "state",
    "joined",
    "joins",
    "round",
    "task",
    "rounds_trained",
    "tasks",
    "last_loss",
    "bytes_up",
    "bytes_down",
    "upload_retries",
    "last_error",
    "last_error_round",
    "uptime_s",
    "time",
}


def _get(url: str, token: str | None = None) -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read(), reply.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Content-Type", "")


def _status(address: str, token: str | None = None) -> dict:
    code, body, content_type = _get(f"http://{address}/api/status", token)
    assert (code, content_type) == (200, "application/json"), body
    return json.loads(body)


def test_client_status_during_and_after_a_round(tmp_path):
    out = tmp_path / "run"
    config = load_config(
        overrides={
            "listen": "127.0.0.1:0",
            "http": "127.0.0.1:0",
            "out": str(out),
            "rounds": ROUNDS,
            "min_clients": 2,
            "threads": THREADS,
            "local_epochs": 1,
            "seed": 0,
        }
    )
    coordinator = threading.Thread(target=lambda: serve(config), daemon=True)
    coordinator.start()
    wait_until(lambda: (out / "http_address").exists(), timeout=60, what="the coordinator's address")
    address = (out / "address").read_text().strip()
    coordinator_http = (out / "http_address").read_text().strip()
    clients = [builtin_client(i, 2, 0) for i in range(2)]
    served = [serve_client_metrics("127.0.0.1:0", name=c.name, coordinator=address) for c in clients]
    during: dict[str, dict] = {}

    fit = clients[0].fit

    def fit_and_look(state, ins):  # round 2, on the client's thread: the task is under way
        if ins.round == 2:
            during["client"] = _status(served[0][1].address)
            during["coordinator"] = _status(coordinator_http)
        return fit(state, ins)

    clients[0].fit = fit_and_look  # type: ignore[method-assign]
    handles = [
        start(c, address, on_task=m.on_task, on_event=m.on_event) for c, (m, _) in zip(clients, served)
    ]
    try:
        summaries = [h.join(timeout=180) for h in handles]
        coordinator.join(timeout=60)
        assert not coordinator.is_alive() and [s.rounds for s in summaries] == [ROUNDS, ROUNDS]
        after = [_status(http.address) for _, http in served]
        metrics = [_get(f"http://{http.address}/metrics")[1].decode() for _, http in served]
    finally:
        for _, http in served:
            http.stop()

    mid, coord = during["client"], during["coordinator"]
    assert set(mid) == FIELDS
    assert (mid["state"], mid["task"], mid["round"], mid["joined"], mid["joins"]) == (
        "fit",
        "fit",
        2,
        True,
        1,
    )
    assert (mid["name"], mid["coordinator"]) == (clients[0].name, address)
    assert mid["run_id"] == coord["run_id"] and mid["client_id"] == summaries[0].client_id
    assert [c["state"] for c in coord["clients"] if c["id"] == mid["client_id"]] == [
        "training"
    ]  # the two views agree
    assert mid["rounds_trained"] == 1 and mid["tasks"]["fit"] == 1  # round 1 done; round 2 not yet counted
    assert mid["last_loss"] is not None and 0.0 < mid["last_loss"] < 10.0
    assert mid["bytes_down"] > 4 * 4810 and mid["bytes_up"] > 4 * 4810  # round 1's model down, its update up
    assert mid["last_error"] is None and mid["uptime_s"] > 0

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == ROUNDS
    for view, client, summary, text in zip(after, clients, summaries, metrics):
        assert set(view) == FIELDS and view["state"] in STATES
        assert (view["state"], view["joined"], view["task"], view["last_error"]) == (
            "finished",
            False,
            None,
            None,
        )
        assert (view["rounds_trained"], view["tasks"]["fit"], view["round"]) == (ROUNDS, ROUNDS, ROUNDS)
        assert (view["name"], view["client_id"], view["run_id"]) == (
            client.name,
            summary.client_id,
            mid["run_id"],
        )
        assert (
            f"fedgrid_client_last_loss {view['last_loss']!r}" in text
        )  # the same loss as /metrics, to the bit
    # The clients' bytes add up to the coordinator's, round by round summed.
    assert sum(v["bytes_up"] for v in after) == sum(r["bytes_up"] for r in rows)
    assert sum(v["bytes_down"] for v in after) == sum(r["bytes_down"] for r in rows)
    assert after[0]["bytes_down"] > mid["bytes_down"] and after[0]["uptime_s"] > mid["uptime_s"]


def test_client_status_follows_the_token_rule(tmp_path):
    token = "t" * 24
    (tmp_path / "token").write_text(token + "\n")
    monitor, http = serve_client_metrics("127.0.0.1:0", token_file=str(tmp_path / "token"), name="edge-1")
    try:
        for path in ("/api/status", "/metrics"):
            code, body, _ = _get(f"http://{http.address}{path}")
            assert (code, body) == (401, b"unauthorized: send Authorization: Bearer TOKEN\n")
            assert _get(f"http://{http.address}{path}", "wrong-" + token)[0] == 401
        status = _status(http.address, token)
        assert (status["name"], status["state"], status["joined"], status["round"], status["task"]) == (
            "edge-1",
            "connecting",
            False,
            0,
            None,
        )
        request = urllib.request.Request(
            f"http://{http.address}/api/status",
            data=b"{}",
            method="POST",
            headers={"Authorization": f"Bearer {token}"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 405  # read-only
    finally:
        http.stop()
    with pytest.raises(
        ConfigError, match="not a loopback address: serving status there needs a bearer token"
    ):
        serve_client_metrics("0.0.0.0:0")


def test_client_status_text_is_escaped_and_bounded():
    """Error text quotes the coordinator and the application: escaped, cut, never verbatim."""
    monitor = ClientMonitor(name="bad\nname\x1b[31m", coordinator="127.0.0.1:5000")
    monitor.on_event(ClientEvent(kind="joined", client_id="abc", run_id="run-1"))
    monitor.on_event(ClientEvent(kind="task", round=4, task="fit"))
    monitor.on_event(
        ClientEvent(kind="error", round=4, detail="ValueError: x\n[FAKE] round 9 committed" + "y" * 5000)
    )
    status = monitor.status()
    assert status["name"] == "'bad\\nname\\x1b[31m'"
    assert status["last_error"].startswith("'ValueError: x\\n[FAKE] round 9 committed") and status[
        "last_error"
    ].endswith("...(+4838 chars)")  # 5,038 characters, 200 kept
    assert len(status["last_error"]) < 250 and status["last_error_round"] == 4
    assert (status["state"], status["round"], status["task"]) == ("fit", 4, "fit")
    monitor.on_event(ClientEvent(kind="polling"))
    assert (monitor.status()["state"], monitor.status()["task"]) == ("idle", None)
    monitor.on_event(ClientEvent(kind="left", detail="CoordinatorUnreachable: no answer from 127.0.0.1:5000"))
    status = monitor.status()
    assert (status["state"], status["joined"]) == ("failed", False)
    assert status["last_error"] == "'CoordinatorUnreachable: no answer from 127.0.0.1:5000'"
    stopped = ClientMonitor()
    stopped.on_event(ClientEvent(kind="left", detail="KeyboardInterrupt: SIGTERM"))
    assert (stopped.status()["state"], stopped.status()["last_error"]) == ("stopped", None)
    assert len(json.dumps(monitor.status())) < 2000  # fixed size, whatever the run did


def test_client_process_serves_status_from_its_flag(tmp_path):
    """``fedgrid client --http``: joined and idle while the coordinator waits for a second client."""
    import re

    from harness import start_client, start_coordinator

    out = tmp_path / "run"
    coordinator, address = start_coordinator(out, "--min-clients", "2", "--rounds", "1")
    client = start_client(address, tmp_path / "client.log", "--http", "127.0.0.1:0", "--partition", "0/2")
    try:
        log = tmp_path / "client.log"
        wait_until(
            lambda: "status on http://" in log.read_text(), timeout=60, what="the client's status address"
        )
        url = re.search(r"status on http://(\S+)/api/status", log.read_text()).group(1)
        wait_until(lambda: _status(url)["joined"], timeout=60, what="the client's join")
        status = _status(url)
        assert (
            status["name"],
            status["coordinator"],
            status["state"],
            status["round"],
            status["rounds_trained"],
        ) == ("digits-0000/2", address, "idle", 0, 0)
        assert status["client_id"] and status["run_id"] and status["last_error"] is None
    finally:
        for proc in (client, coordinator):
            proc.kill()
            proc.wait(timeout=30)
