"""The ``--http`` status server cannot be held: a coordinator's ``/metrics`` and ``/api/status``
stay at 200 while 64 slowloris connections drip a byte at a time, one peer that opens more
than its share is refused without taking anyone else's, and a whole-request deadline closes a
peer that keeps sending, however it paces its bytes.

The slow peers dial from their own loopback addresses (127.0.0.2 and up: Linux routes all of
127/8 to ``lo``), so each is a distinct peer to the per-peer cap, as hosts on a network are.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from datetime import timedelta

import pytest

from fedgrid.server.monitor import CoordinatorMonitor
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.types import ClientInfo
from fedgrid.webserve import Limits, StatusServer

from harness import wait_until

SLOW_PEERS = 64
#: Seconds between two bytes of a slow peer: well under any per-read timeout.
DRIP_S = 0.05


def _get(address: str, path: str) -> tuple[int, bytes]:
    return _get_from(address, path, "127.0.0.1")


def _get_from(address: str, path: str, source: str) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10, source_address=(source, 0))
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def _slow_peer(address: str, source: str) -> socket.socket:
    """A connection from ``source`` that has sent the start of a request and never its end."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0))
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: fedgrid\r\nX-Slow: ")
    return sock


class _Drip:
    """Sends one byte on each socket every ``DRIP_S`` seconds, on a thread, until closed."""

    def __init__(self, socks: list[socket.socket]) -> None:
        self.socks, self.stop, self.sent = socks, threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(DRIP_S):  # pacing the attack, not waiting for a result
            for sock in self.socks:
                try:
                    sock.send(b"a")
                    self.sent += 1
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        for sock in self.socks:
            sock.close()


def _still_open(sock: socket.socket) -> bool:
    """Whether the server neither answered nor closed ``sock``."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)
    return False


@pytest.fixture
def coordinator_http():
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    fleet.join(ClientInfo("", name="honest", region="eu-west", num_examples=700))
    monitor = CoordinatorMonitor(fleet, rounds=3, history=lambda: [])
    server = StatusServer("127.0.0.1:0", monitor.routes()).start()  # the default limits
    yield server
    server.stop()
    fleet.close()


def test_metrics_stay_200_under_64_slowloris_connections(coordinator_http):
    server = coordinator_http
    slow = [_slow_peer(server.address, f"127.0.0.{2 + i}") for i in range(SLOW_PEERS)]
    drip = _Drip(slow)
    try:
        wait_until(lambda: server.connections == SLOW_PEERS, timeout=10, what="64 slow connections held")
        sent = drip.sent
        for _ in range(10):
            status, body = _get(server.address, "/metrics")
            assert status == 200 and b"fedgrid_live_clients 1.0" in body, (status, body[:200])
            status, body = _get(server.address, "/api/status")
            assert status == 200 and [c["name"] for c in json.loads(body)["clients"]] == ["honest"]
        wait_until(lambda: drip.sent >= sent + SLOW_PEERS, timeout=10, what="a byte on every slow peer")
        # The slow peers were held all along (neither answered nor refused): the server was not.
        assert all(_still_open(sock) for sock in slow)
        wait_until(lambda: server.connections == SLOW_PEERS, timeout=10, what="the honest connections closed")
    finally:
        drip.close()


def test_one_peer_over_its_share_is_refused_and_holds_no_one_elses_slot(coordinator_http):
    server = coordinator_http
    share = server.limits.max_connections_per_peer
    slow = [_slow_peer(server.address, "127.0.0.66") for _ in range(SLOW_PEERS)]
    try:
        wait_until(
            lambda: sum(not _still_open(s) for s in slow) == SLOW_PEERS - share,
            timeout=10,
            what=f"{SLOW_PEERS - share} connections refused",
        )
        assert server.connections == share
        held = [s for s in slow if _still_open(s)]
        refused = [s for s in slow if s not in held]
        assert len(held) == share
        assert all(s.recv(200).startswith(b"HTTP/1.1 503 Service Unavailable\r\n") for s in refused)
        assert _get(server.address, "/metrics")[0] == 200  # another peer is served
    finally:
        for sock in slow:
            sock.close()


def test_the_whole_request_deadline_closes_a_peer_that_keeps_sending():
    deadline = 0.5
    server = StatusServer(
        "127.0.0.1:0", {}, limits=Limits(request_timeout_s=deadline, max_connections=4)
    ).start()
    try:
        opened = time.monotonic()
        sock = _slow_peer(server.address, "127.0.0.2")
        drip = _Drip([sock])
        try:
            sock.settimeout(10)
            try:
                assert sock.recv(100) == b""  # closed without an answer
            except ConnectionResetError:
                pass  # or reset: either way the peer lost its connection
            closed_after = time.monotonic() - opened
        finally:
            drip.close()
        # It sent a byte every 0.05 s, so only a whole-request deadline could close it.
        assert drip.sent >= 5
        assert deadline <= closed_after < deadline + 3, closed_after
        wait_until(lambda: server.connections == 0, timeout=10, what="the slot freed")
        assert _get(server.address, "/missing")[0] == 404  # and the server still answers
    finally:
        server.stop()


CHURNERS = 20
PROBES = 15


def _churn(address: str, source: str, stop: threading.Event, connects: list[int]) -> None:
    """Reconnects from ``source`` as soon as the server drops the connection, until ``stop``:
    each connection sends the start of a request and waits for the server to end it."""
    host, port = address.rsplit(":", 1)
    while not stop.is_set():
        try:
            with socket.create_connection((host, int(port)), timeout=2, source_address=(source, 0)) as sock:
                connects[0] += 1
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: fedgrid\r\nX-Churn: ")
                while not stop.is_set() and sock.recv(4096):
                    pass
        except OSError:
            pass  # refused, reset or timed out: dial again at once


def test_a_prober_on_another_address_is_answered_while_20_churning_sockets_hammer_from_one(coordinator_http):
    """The per-peer cap, measured with the attacker and the prober on different addresses
    (127.0.0.2 and 127.0.0.3): the attacker's 20 sockets hold its 8 slots and redial the
    moment they are refused; the prober still gets its answers."""
    server = coordinator_http
    stop, connects = threading.Event(), [0]
    churners = [
        threading.Thread(target=_churn, args=(server.address, "127.0.0.2", stop, connects), daemon=True)
        for _ in range(CHURNERS)
    ]
    for thread in churners:
        thread.start()
    try:
        share = server.limits.max_connections_per_peer
        wait_until(
            lambda: server.connections == share and connects[0] > 5 * CHURNERS, timeout=10, what="the churn"
        )
        answers = []
        for _ in range(PROBES):
            try:
                status, body = _get_from(server.address, "/metrics", "127.0.0.3")
                answers.append(status == 200 and b"fedgrid_live_clients 1.0" in body)
            except OSError:
                answers.append(False)
        churned = connects[0]
    finally:
        stop.set()
        for thread in churners:
            thread.join(timeout=10)
    assert sum(answers) >= PROBES - 1, answers
    assert churned > 10 * CHURNERS  # the attacker really redialled throughout
