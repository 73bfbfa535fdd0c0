"""The emulated WAN (``fedgrid.ops.wan``) over real sockets: RTT, bandwidth, loss, partitions as
gRPC sees them, a fedgrid round across it, bounded buffers, and ``fedgrid wan``.

Every server binds port 0; waits are on conditions with deadlines; the time bounds are the
model's (a lower bound the relay can never beat) plus slack for a loaded 2-core machine.
"""

from __future__ import annotations

import hashlib
import select
import signal
import socket
import socketserver
import statistics
import subprocess
import threading
import time
from collections import OrderedDict
from concurrent import futures
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedgrid.client import start_client
from fedgrid.ops.wan import MSS, WanLink, WanRelay, parse_hostport

import zygote
from harness import FEDGRID, InProcessCoordinator, child_env, wait_until
from harness_clients import Named


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            while data := self.request.recv(1 << 16):
                self.request.sendall(data)
        except OSError:  # the relay reset the connection
            pass


class _Digest(socketserver.BaseRequestHandler):
    """Reads to EOF, then answers the byte count and SHA-256 of what it got."""

    def handle(self) -> None:
        h, n = hashlib.sha256(), 0
        try:
            while data := self.request.recv(1 << 20):
                h.update(data)
                n += len(data)
            self.request.sendall(n.to_bytes(8, "big") + h.digest())
        except OSError:
            pass


def _serve(handler: type[socketserver.BaseRequestHandler]) -> Iterator[tuple[str, int]]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[:2]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    yield from _serve(_Echo)


@pytest.fixture
def digest() -> Iterator[tuple[str, int]]:
    yield from _serve(_Digest)


def _connect(relay: WanRelay) -> socket.socket:
    sock = socket.create_connection(parse_hostport(relay.address), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        data = sock.recv(n - len(out))
        if not data:
            raise AssertionError(f"connection closed after {len(out)} of {n} bytes")
        out += data
    return bytes(out)


def _transfer(relay: WanRelay, payload: bytes) -> float:
    """Sends ``payload`` through the relay to the digest server; returns the seconds until
    its digest came back, after checking it names every byte in order."""
    with _connect(relay) as sock:
        began = time.monotonic()
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        answer = _recv_exactly(sock, 40)
        elapsed = time.monotonic() - began
    assert int.from_bytes(answer[:8], "big") == len(payload)
    assert answer[8:] == hashlib.sha256(payload).digest()
    return elapsed


def test_the_round_trip_time_is_twice_the_delay(echo):
    with WanRelay(echo, WanLink(delay_ms=25)) as relay, _connect(relay) as sock:
        rtts = []
        for i in range(9):
            began = time.monotonic()
            sock.sendall(bytes([i]))
            assert _recv_exactly(sock, 1) == bytes([i])
            rtts.append(time.monotonic() - began)
    assert min(rtts) >= 0.050  # each byte waits 25 ms each way, never less
    assert statistics.median(rtts) < 0.050 + 0.040, rtts
    assert relay.bytes_up == relay.bytes_down == 9 and relay.connections_total == 1


def test_a_large_transfer_moves_at_the_rate(digest):
    payload = (
        torch.randint(0, 256, (4_000_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        .numpy()
        .tobytes()
    )
    with WanRelay(digest, WanLink(rate_mbit=20)) as relay:
        elapsed = _transfer(relay, payload)
        assert relay.bytes_up == 4_000_000 and relay.bytes_down == 40
    ideal = 4e6 * 8 / 20e6  # 1.6 s
    assert elapsed >= ideal - 0.005  # one 5 kB piece (2 ms) of burst at most
    assert elapsed < ideal * 1.25 + 0.5, f"{elapsed:.2f}s for {ideal:.2f}s of link time"


def test_connections_share_the_link(digest):
    payloads = [bytes([i]) * 2_000_000 for i in range(2)]
    with WanRelay(digest, WanLink(rate_mbit=20)) as relay:
        began = time.monotonic()
        with futures.ThreadPoolExecutor(2) as pool:
            each = list(pool.map(lambda p: _transfer(relay, p), payloads))
        elapsed = time.monotonic() - began
        assert relay.bytes_up == 4_000_000 and relay.connections_total == 2
    # 4 MB in all through one 20 Mbit/s link: 1.6 s, not the 0.8 s of a limit per connection.
    assert 1.6 - 0.01 <= elapsed < 1.6 * 1.25 + 0.5
    # They take turns (about 10 Mbit/s each): neither goes first at the full rate (0.8 s).
    assert min(each) > 1.2, each


def test_lost_segments_cost_one_rto_each_and_the_data_arrives_intact(digest):
    payload = bytes(range(256)) * (300_000 // 256)
    segments = -(-len(payload) // MSS)
    clean_link = WanLink(delay_ms=5, rate_mbit=20)
    lossy_link = WanLink(delay_ms=5, rate_mbit=20, loss=0.05, seed=11)
    with WanRelay(digest, clean_link) as relay:
        clean = min(_transfer(relay, payload) for _ in range(2))
    with WanRelay(digest, lossy_link) as relay:
        lossy = _transfer(relay, payload)
        lost = relay.segments_lost
    # Seeded: the same segments every run; 207 up (and one of the 40-byte answer) at 5 %.
    assert 0.4 * segments * 0.05 <= lost <= 2.5 * segments * 0.05
    assert lossy >= len(payload) * 8 / 20e6 + lost * lossy_link.rto_s  # the model's floor
    assert lossy - clean == pytest.approx(lost * lossy_link.rto_s, abs=0.6), (lossy, clean, lost)


@pytest.fixture
def grpc_server() -> Iterator[tuple[str, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield ("127.0.0.1", port)
    finally:
        server.stop(grace=None)


def _check(channel: grpc.Channel, timeout: float, wait_for_ready: bool = False) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=timeout, wait_for_ready=wait_for_ready
    )
    return reply.status


def _code(channel: grpc.Channel, timeout: float) -> tuple[grpc.StatusCode, float]:
    began = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        _check(channel, timeout)
    return err.value.code(), time.monotonic() - began


def _assert_reset_on_arrival(relay: WanRelay) -> None:
    """A new connection to the relay is reset at once (no byte comes back) and counted."""
    refused = relay.connections_refused
    try:  # the reset may reach the connect itself, the send or the read
        with _connect(relay) as sock:
            sock.sendall(b"?")
            assert sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        pass
    wait_until(lambda: relay.connections_refused > refused, timeout=10, what="the relay to count the reset")


FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 300),
]


def test_a_blackhole_times_grpc_calls_out_at_their_deadline_until_healed(grpc_server):
    with WanRelay(grpc_server, WanLink(delay_ms=5)) as relay, grpc.insecure_channel(relay.address) as channel:
        assert _check(channel, timeout=10) == health_pb2.HealthCheckResponse.SERVING
        relay.partition("blackhole")
        code, elapsed = _code(channel, timeout=1.0)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and 0.9 <= elapsed < 5
        # A new connection is accepted, and stalls as well (a channel of its own: channels
        # share connections to one target by default).
        with grpc.insecure_channel(relay.address, options=[("grpc.use_local_subchannel_pool", 1)]) as fresh:
            code, elapsed = _code(fresh, timeout=1.0)
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and 0.9 <= elapsed < 5
            assert relay.connections_open == 2
            relay.heal()
            assert _check(channel, timeout=10) == health_pb2.HealthCheckResponse.SERVING
            assert _check(fresh, timeout=10) == health_pb2.HealthCheckResponse.SERVING
        assert relay.partitioned is None


def test_a_reset_partition_makes_grpc_calls_unavailable_until_healed(grpc_server):
    with (
        WanRelay(grpc_server, WanLink(delay_ms=5)) as relay,
        grpc.insecure_channel(relay.address, options=FAST_RECONNECT) as channel,
    ):
        assert _check(channel, timeout=10) == health_pb2.HealthCheckResponse.SERVING
        relay.partition("reset")
        wait_until(lambda: relay.connections_open == 0, timeout=10, what="the connection to be reset")
        code, elapsed = _code(channel, timeout=10)
        assert code == grpc.StatusCode.UNAVAILABLE and elapsed < 5  # refused, not left to time out
        _assert_reset_on_arrival(relay)
        relay.heal()
        assert _check(channel, timeout=20, wait_for_ready=True) == health_pb2.HealthCheckResponse.SERVING


def test_a_fedgrid_round_crosses_the_wan_and_the_relay_counts_its_bytes():
    state = OrderedDict(
        [("w", torch.randn(250_000, generator=torch.Generator().manual_seed(0))), ("b", torch.zeros(10))]
    )
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    server = InProcessCoordinator(state)
    rate_mbit = 40
    try:
        with WanRelay(server.address, WanLink(delay_ms=10, rate_mbit=rate_mbit)) as relay:
            handle = start_client(Named("far"), relay.address, poll_wait_s=1.0)
            wait_until(
                lambda: len(server.fleet.live_clients()) == 1,
                timeout=30,
                what="the client to join across the WAN",
            )
            began = time.monotonic()
            server.open_round()
            outcome = server.wait_round(timeout=60)
            elapsed = time.monotonic() - began
            assert [r.client.name for r in outcome.results] == ["far"]
            assert torch.equal(outcome.results[0].state["w"], state["w"] + 1)
            server.fleet.finish(timeout=timedelta(seconds=30))
            handle.join(timeout=30)
            assert outcome.bytes_down >= model_bytes and outcome.bytes_up >= model_bytes
            # What the coordinator sent and received crossed the relay, framing and HTTP/2 on top.
            assert outcome.bytes_down <= relay.bytes_down < outcome.bytes_down * 1.1 + 200_000
            assert outcome.bytes_up <= relay.bytes_up < outcome.bytes_up * 1.1 + 200_000
            # The download and the upload follow each other: each at 40 Mbit/s at most.
            assert elapsed >= (outcome.bytes_down + outcome.bytes_up) * 8 / (rate_mbit * 1e6)
    finally:
        server.stop()


def test_a_receiver_that_does_not_read_blocks_the_sender_at_a_bounded_buffer():
    listener = socket.create_server(("127.0.0.1", 0))
    link = WanLink(delay_ms=5, rate_mbit=1000)
    with listener, WanRelay(listener.getsockname()[:2], link) as relay, _connect(relay) as sock:
        peer, _ = listener.accept()  # accepts, never reads
        with peer:
            sock.setblocking(False)
            chunk, sent = bytes(1 << 16), 0
            while select.select([], [sock], [], 1.0)[1]:  # writable within a second: not blocked yet
                try:
                    sent += sock.send(chunk)
                except BlockingIOError:
                    continue
                assert sent < 512 << 20, "the relay kept reading: no backpressure"
            kernel = sum(
                s.getsockopt(socket.SOL_SOCKET, o)
                for s in (sock, peer)
                for o in (socket.SO_SNDBUF, socket.SO_RCVBUF)
            )
            # The sender's and receiver's kernel buffers, the relay's two sockets' (about as
            # large), the relay's bound and one read: nothing unbounded in between.
            assert sent <= 2 * kernel + link.buffer_bytes + (1 << 17), (sent, kernel, link.buffer_bytes)
            assert relay.bytes_up < sent


def test_connections_over_the_maximum_are_reset(echo):
    with WanRelay(echo, max_connections=1) as relay, _connect(relay) as first:
        first.sendall(b"a")
        assert _recv_exactly(first, 1) == b"a"
        _assert_reset_on_arrival(relay)
        assert relay.connections_refused == 1 and relay.connections_total == 1
        first.sendall(b"c")
        assert _recv_exactly(first, 1) == b"c"


def test_set_link_changes_the_delay_of_a_running_connection(echo):
    with WanRelay(echo, WanLink(delay_ms=5)) as relay, _connect(relay) as sock:

        def rtt() -> float:
            began = time.monotonic()
            sock.sendall(b"x")
            _recv_exactly(sock, 1)
            return time.monotonic() - began

        assert (
            min(rtt() for _ in range(3)) < 0.010 + 0.050
        )  # well under what follows, on a loaded machine too
        relay.set_link(WanLink(delay_ms=60))
        assert rtt() >= 0.120


def test_the_fedgrid_wan_command_relays_and_exits_143_on_sigterm(echo, tmp_path: Path):
    address_file = tmp_path / "runs" / "wan" / "address"  # its folders do not exist yet: made
    proc = zygote.popen(
        [
            *FEDGRID,
            "wan",
            "--target",
            f"127.0.0.1:{echo[1]}",
            "--delay-ms",
            "20",
            "--rate-mbit",
            "20",
            "--loss",
            "0.001",
            "--address-file",
            str(address_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
    )
    try:
        wait_until(
            lambda: address_file.exists() or proc.poll() is not None,
            timeout=30,
            what="the relay's address file",
        )
        assert proc.poll() is None
        host, port = parse_hostport(address_file.read_text().strip())
        assert host == "127.0.0.1" and port > 0
        with socket.create_connection((host, port), timeout=30) as sock:
            began = time.monotonic()
            sock.sendall(b"ping")
            assert _recv_exactly(sock, 4) == b"ping"
            assert time.monotonic() - began >= 0.040
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert (
        f"fedgrid wan relaying 127.0.0.1:{port} -> 127.0.0.1:{echo[1]}: delay 20 ms each way (RTT +40 ms), 20 Mbit/s, loss 0.001"
        in out
    )
    assert "SIGTERM: stopping the relay" in out
    assert "fedgrid wan stopped: 1 connections, 4 bytes up, 4 bytes down" in out


def test_the_fedgrid_wan_command_refuses_a_bad_flag_naming_it(capsys):
    from fedgrid import cli

    assert cli.main(["wan", "--target", "localhost", "--delay-ms", "5"]) == 2
    assert (
        capsys.readouterr().err
        == "fedgrid: error: config key 'target': expected HOST:PORT, not 'localhost'\n"
    )
    assert cli.main(["wan", "--target", "127.0.0.1:1", "--loss", "1.5"]) == 2
    assert "config key 'loss': is a probability per segment, in [0, 1), not 1.5" in capsys.readouterr().err


def test_an_address_file_whose_folder_cannot_be_made_stops_before_the_relay_line(tmp_path, capsys):
    from fedgrid import cli

    (tmp_path / "runs").write_text("a file where the folder would go")
    address_file = tmp_path / "runs" / "wan" / "address"
    assert cli.main(["wan", "--target", "127.0.0.1:1", "--address-file", str(address_file)]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no relay line: the clients never see an address that is not there
    assert err == (
        f"fedgrid: error: config key 'address_file': cannot make the folder {str(address_file.parent)!r}: "
        "Not a directory\n"
    )
