"""Transport benchmark: fedgrid's model download and upload next to bare grpcio and a TCP socket.

For each model size and direction it measures, in one run and interleaved repetition by
repetition, the throughput of:

- ``fedgrid``: the coordinator (``Coordinator`` over a ``RemoteFleet``) and the client SDK's
  ``Connection``; download is ``Connection.download`` (chunk stream, checksums, tensor
  assembly), upload is ``Connection.upload`` up to the server's reply, which comes only
  after the server has assembled and validated the update (shapes, checksums, NaN/Inf).
- ``grpc``: a generic grpcio server with identity serializers streaming the same bytes in
  messages of the same size (server->client for download, client->server for upload). The
  receiver only counts the bytes: this is what grpcio itself can carry.
- ``socket``: the same bytes over one TCP connection on 127.0.0.1, received with
  ``recv_into`` a preallocated buffer: the physical limit of the machine.
- ``fedgrid-tls`` and ``grpc-tls`` (``--tls``): ``fedgrid`` and ``grpc`` over mutual TLS
  (the client presents a certificate, the server requires one), with a CA, a server
  certificate for 127.0.0.1 and a client certificate made once per run by ``fedgrid.pki``
  in a temporary directory. ``fedgrid-tls/fedgrid`` is what TLS costs fedgrid,
  ``grpc-tls/grpc`` what it costs grpcio itself.

Server and client of every transport live in separate processes (spawned), as they do in a
deployment; the parent only sends commands and collects timings. Times are taken on the
client from the request to complete receipt (download) or to the server's reply (upload).
Throughput is payload bytes / median time, in MB/s (10^6 bytes). Each side's CPU time per repetition
(all threads, user + system) is reported per GB moved; the harness's own comparison of the
uploaded model with the one sent (``FedgridServer.verify``) runs after the reading, outside it.

    python benchmarks/transport.py                 # 10M and 100M float32 parameters
    python benchmarks/transport.py --sizes 1M --repeats 3 --out /tmp/t.json
    python benchmarks/transport.py --sizes 100M --fedgrid-env FEDGRID_BUFFER_POOL_BYTES=0   # also fedgrid so, as "fedgrid-env"
    python benchmarks/transport.py --sizes 100M --repeats 5 --tls                          # also fedgrid-tls, grpc-tls
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import OrderedDict
from concurrent import futures
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection as Pipe
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any, Callable

import grpc
import torch

__all__ = ["main", "run_benchmark", "parse_size"]

TRANSPORTS = ("fedgrid", "grpc", "socket")
#: The mutual-TLS twin of a transport (``--tls``), run next to it.
TLS_TWIN = {"fedgrid": "fedgrid-tls", "grpc": "grpc-tls"}
#: Every transport, in the order a run interleaves them.
ALL_TRANSPORTS = ("fedgrid", "fedgrid-tls", "grpc", "grpc-tls", "socket")
#: File names in the run's certificate directory (``make_certs``).
SERVER_CERT, CLIENT_CERT = "server", "bench"
#: fedgrid again, its peers started with ``--fedgrid-env``'s settings (before/after in one run).
VARIANT = "fedgrid-env"
DIRECTIONS = ("download", "upload")
NUM_TENSORS = 4
#: Deadline of one command sent to a peer process (one repetition of the largest size).
COMMAND_TIMEOUT_S = 300.0
#: Deadline for a peer process to start (interpreter, torch import, model generation).
START_TIMEOUT_S = 120.0
#: Deadline of one transfer inside a peer (gRPC calls, socket operations).
TRANSFER_TIMEOUT_S = 240.0
#: Same message caps as fedgrid's server and client (``fedgrid.constants.MAX_MESSAGE_BYTES``).
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
MB = 1e6


def make_state(num_params: int) -> "OrderedDict[str, torch.Tensor]":
    """A float32 model of ``num_params`` parameters in ``NUM_TENSORS`` tensors, the same in every process."""
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(num_params, generator=gen)
    return OrderedDict(
        (f"layer{i}.weight", t.clone()) for i, t in enumerate(torch.tensor_split(flat, NUM_TENSORS))
    )


def payload_chunks(num_params: int, chunk_size: int) -> list[bytes]:
    """The model's bytes cut as fedgrid cuts them: per tensor, in pieces of ``chunk_size``."""
    out: list[bytes] = []
    for tensor in make_state(num_params).values():
        view = tensor.view(torch.uint8).numpy().data
        out.extend(bytes(view[i : i + chunk_size]) for i in range(0, len(view), chunk_size))
    return out


# -- peers: each runs in its own process ------------------------------------------------------
# A peer answers commands from the parent: ``arm(k)`` before repetition k (servers),
# ``rep(k)`` runs it and returns (download_s, upload_s) (clients), ``collect()`` checks what
# the server received. Baseline peers import no fedgrid code.


@dataclass(frozen=True)
class PeerSpec:
    transport: str
    role: str  # "server" or "client"
    num_params: int
    chunk_size: int
    address: str = ""
    env: tuple[tuple[str, str], ...] = ()  # set in the peer's process before it starts
    tls_dir: str = ""  # mutual TLS with the certificates of ``make_certs`` there; "" plaintext


def make_certs(directory: Path) -> Path:
    """A CA, a server certificate for 127.0.0.1 / localhost and a client certificate in
    ``directory`` (``fedgrid.pki``, EC P-256), as an operator makes them with ``fedgrid certs``."""
    from fedgrid.ops import pki

    pki.init_ca(directory)
    pki.issue(directory, SERVER_CERT, server=True, sans=("127.0.0.1", "localhost"))
    pki.issue(directory, CLIENT_CERT)
    return directory


def _pem_paths(tls_dir: str, role: str) -> tuple[Path, Path, Path]:
    """(CA, certificate, key) of ``role``'s side in a ``make_certs`` directory."""
    d = Path(tls_dir)
    name = SERVER_CERT if role == "server" else CLIENT_CERT
    return d / "ca.pem", d / f"{name}.pem", d / f"{name}.key"


def _fedgrid_tls(spec: PeerSpec) -> Any:
    """The peer's ``TLSFiles``, or ``None`` for plaintext."""
    from fedgrid.proto.tls import TLSFiles

    return TLSFiles(*map(str, _pem_paths(spec.tls_dir, spec.role))) if spec.tls_dir else None


class FedgridServer:
    """Coordinator + RemoteFleet; each repetition is one ``fit_round`` with the client."""

    def __init__(self, spec: PeerSpec) -> None:
        from fedgrid.server.remote_fleet import RemoteFleet
        from fedgrid.server.serve import Coordinator

        self.state = make_state(spec.num_params)
        # The harness sends no heartbeats: a long interval keeps the client registered.
        self.fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=600), chunk_size=spec.chunk_size)
        self.coordinator = Coordinator("127.0.0.1:0", self.fleet, tls=_fedgrid_tls(spec)).start()
        self.address = self.coordinator.address
        self._thread: threading.Thread | None = None
        self._outcome: Any = None
        self._error: BaseException | None = None
        self._round = 0
        self._received: Any = None  # the last repetition's upload, until ``verify``

    def arm(self, server_round: int) -> None:
        from fedgrid.types import FitIns

        clients = self.fleet.wait_for_clients(min_clients=1, timeout=timedelta(seconds=30))
        self._outcome, self._error = None, None
        self._round = server_round

        def target() -> None:
            try:
                self._outcome = self.fleet.fit_round(
                    server_round=server_round,
                    global_state=self.state,
                    assignments=[(clients[0], FitIns(round=server_round))],
                    timeout=timedelta(seconds=TRANSFER_TIMEOUT_S),
                )
            except BaseException as exc:  # reported by collect()
                self._error = exc

        self._thread = threading.Thread(target=target, name="bench-round", daemon=True)
        self._thread.start()

    def collect(self) -> dict[str, int]:
        assert self._thread is not None
        self._thread.join(TRANSFER_TIMEOUT_S)
        if self._thread.is_alive():
            raise TimeoutError(f"fit_round still running after {TRANSFER_TIMEOUT_S}s")
        if self._error is not None:
            raise self._error
        outcome, self._outcome = self._outcome, None
        if outcome.failures or len(outcome.results) != 1:
            raise RuntimeError(f"round failed: {[f.reason for f in outcome.failures]}")
        self._received = outcome.results[0].state
        self.fleet.committed(self._round)  # as the round engine does: the round's updates go
        return {"bytes_up": outcome.bytes_up, "bytes_down": outcome.bytes_down}

    def verify(self) -> None:
        """The harness's own check, after the repetition's CPU reading: the upload is the model."""
        received, self._received = self._received, None
        for name, tensor in self.state.items():
            if not torch.equal(received[name], tensor):
                raise RuntimeError(f"uploaded tensor {name!r} differs from the global model")

    def close(self) -> None:
        self.coordinator.stop(grace=1.0)


class FedgridClient:
    """The client SDK's ``Connection``: poll for the task, download it, upload it back."""

    def __init__(self, spec: PeerSpec) -> None:
        from fedgrid.client.api import Client
        from fedgrid.client.runtime import Connection

        class _Stub(Client):
            name = "bench"
            num_examples = 1  # at Join: an update may claim no more (fleet/bounds.py)

            def fit(self, state, ins):  # type: ignore[no-untyped-def]
                raise AssertionError("the benchmark never trains")

        self.nbytes = spec.num_params * 4
        self.conn = Connection(spec.address, tls=_fedgrid_tls(spec))
        self.conn.join(_Stub())

    def rep(self, server_round: int) -> tuple[float, float]:
        reply = self.conn.poll(30.0)
        if reply.WhichOneof("reply") != "task" or reply.task.round != server_round:
            raise RuntimeError(f"expected the task of round {server_round}, got {reply}")
        task_id = reply.task.task_id
        t0 = time.perf_counter()
        state = self.conn.download(task_id)
        t1 = time.perf_counter()
        received = self.conn.upload(task_id, server_round, state, 1, {})
        t2 = time.perf_counter()
        if (
            sum(t.numel() * t.element_size() for t in state.values()) != self.nbytes
            or received != self.nbytes
        ):
            raise RuntimeError(f"moved the wrong number of bytes (server acknowledged {received})")
        return t1 - t0, t2 - t1

    def close(self) -> None:
        self.conn.close()


SERVICE = "bench.Transport"


class GrpcServer:
    """A generic grpcio server: raw ``bytes`` messages, no protobuf, no fedgrid."""

    def __init__(self, spec: PeerSpec) -> None:
        self.chunks = payload_chunks(spec.num_params, spec.chunk_size)
        self.last_upload = 0
        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Download": grpc.unary_stream_rpc_method_handler(self._download),
                "Upload": grpc.stream_unary_rpc_method_handler(self._upload),
            },
        )
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS + [("grpc.so_reuseport", 0)]
        )
        self.server.add_generic_rpc_handlers((handler,))
        if spec.tls_dir:  # as fedgrid's coordinator: a client certificate of the CA required
            ca, cert, key = (p.read_bytes() for p in _pem_paths(spec.tls_dir, "server"))
            credentials = grpc.ssl_server_credentials(
                [(key, cert)], root_certificates=ca, require_client_auth=True
            )
            port = self.server.add_secure_port("127.0.0.1:0", credentials)
        else:
            port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.address = f"127.0.0.1:{port}"

    def _download(self, request: bytes, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        yield from self.chunks

    def _upload(self, request_iterator, context: grpc.ServicerContext) -> bytes:  # type: ignore[no-untyped-def]
        total = 0
        for message in request_iterator:
            total += len(message)
        self.last_upload = total
        return total.to_bytes(8, "little")

    def arm(self, server_round: int) -> None:
        self.last_upload = 0

    def collect(self) -> dict[str, int]:
        return {"bytes_up": self.last_upload}

    def verify(self) -> None:
        """Nothing kept to compare: ``collect`` checked the byte count."""

    def close(self) -> None:
        self.server.stop(grace=1.0).wait(2.0)


class GrpcClient:
    def __init__(self, spec: PeerSpec) -> None:
        self.chunks = payload_chunks(spec.num_params, spec.chunk_size)
        self.nbytes = sum(len(c) for c in self.chunks)
        if spec.tls_dir:
            ca, cert, key = (p.read_bytes() for p in _pem_paths(spec.tls_dir, "client"))
            credentials = grpc.ssl_channel_credentials(
                root_certificates=ca, private_key=key, certificate_chain=cert
            )
            self.channel = grpc.secure_channel(spec.address, credentials, options=GRPC_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(spec.address, options=GRPC_OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.download = self.channel.unary_stream(f"/{SERVICE}/Download")
        self.upload = self.channel.stream_unary(f"/{SERVICE}/Upload")

    def rep(self, server_round: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        got = 0
        for message in self.download(b"", timeout=TRANSFER_TIMEOUT_S):
            got += len(message)
        t1 = time.perf_counter()
        acked = int.from_bytes(self.upload(iter(self.chunks), timeout=TRANSFER_TIMEOUT_S), "little")
        t2 = time.perf_counter()
        if got != self.nbytes or acked != self.nbytes:
            raise RuntimeError(f"grpc moved {got} down, {acked} up, expected {self.nbytes}")
        return t1 - t0, t2 - t1

    def close(self) -> None:
        self.channel.close()


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed after {got} of {len(view)} bytes")
        got += n


def _send_chunked(sock: socket.socket, view: memoryview, chunk_size: int) -> None:
    for i in range(0, len(view), chunk_size):
        sock.sendall(view[i : i + chunk_size])


class SocketServer:
    """One TCP connection: ``D`` asks for the payload, ``U`` precedes an upload acked with ``K``."""

    def __init__(self, spec: PeerSpec) -> None:
        self.payload = memoryview(b"".join(payload_chunks(spec.num_params, spec.chunk_size)))
        self.inbox = memoryview(
            bytearray(len(self.payload))
        )  # allocated and touched once, reused: the best case
        self.chunk_size = spec.chunk_size
        self.last_upload = 0
        self.error: BaseException | None = None
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(START_TIMEOUT_S)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, name="bench-socket", daemon=True).start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
            with conn:
                conn.settimeout(None)  # idle between repetitions; the parent's deadlines bound a stall
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while op := conn.recv(1):
                    if op == b"D":
                        _send_chunked(conn, self.payload, self.chunk_size)
                    elif op == b"U":
                        _recv_exactly(conn, self.inbox)
                        self.last_upload = len(self.inbox)
                        conn.sendall(b"K")
                    else:
                        raise ValueError(f"unknown op {op!r}")
        except BaseException as exc:  # reported by collect()
            self.error = exc

    def arm(self, server_round: int) -> None:
        self.last_upload = 0

    def collect(self) -> dict[str, int]:
        if self.error is not None:
            raise self.error
        if self.last_upload != len(self.inbox):
            raise RuntimeError(f"socket upload delivered {self.last_upload} of {len(self.inbox)} bytes")
        return {"bytes_up": self.last_upload}

    def verify(self) -> None:
        """Nothing kept to compare: ``collect`` checked the byte count."""

    def close(self) -> None:
        self.listener.close()


class SocketClient:
    def __init__(self, spec: PeerSpec) -> None:
        self.payload = memoryview(b"".join(payload_chunks(spec.num_params, spec.chunk_size)))
        self.inbox = memoryview(bytearray(len(self.payload)))
        self.chunk_size = spec.chunk_size
        host, _, port = spec.address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=TRANSFER_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def rep(self, server_round: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        self.sock.sendall(b"D")
        _recv_exactly(self.sock, self.inbox)
        t1 = time.perf_counter()
        self.sock.sendall(b"U")
        _send_chunked(self.sock, self.payload, self.chunk_size)
        ack = self.sock.recv(1)
        t2 = time.perf_counter()
        if (
            ack != b"K" or self.inbox.obj != self.payload.obj
        ):  # bytearray == bytes is a memcmp; memoryviews compare slowly
            raise RuntimeError("socket transfer lost or corrupted bytes")
        return t1 - t0, t2 - t1

    def close(self) -> None:
        self.sock.close()


PEERS: dict[tuple[str, str], Callable[[PeerSpec], Any]] = {
    ("fedgrid", "server"): FedgridServer,
    ("fedgrid", "client"): FedgridClient,
    (VARIANT, "server"): FedgridServer,
    (VARIANT, "client"): FedgridClient,
    ("fedgrid-tls", "server"): FedgridServer,
    ("fedgrid-tls", "client"): FedgridClient,
    ("grpc-tls", "server"): GrpcServer,
    ("grpc-tls", "client"): GrpcClient,
    ("grpc", "server"): GrpcServer,
    ("grpc", "client"): GrpcClient,
    ("socket", "server"): SocketServer,
    ("socket", "client"): SocketClient,
}


def _peer_main(spec: PeerSpec, pipe: Pipe) -> None:
    """Entry point of a peer process: build the peer, then answer commands until ``stop``."""
    peer = None
    try:
        os.environ.update(spec.env)  # before any fedgrid import: its constants read the environment
        peer = PEERS[(spec.transport, spec.role)](spec)
        pipe.send(("ok", getattr(peer, "address", "")))
        while True:
            command, args = pipe.recv()
            if command == "stop":
                break
            if command == "cpu":  # CPU seconds of the whole process (every thread, user + system) so far
                pipe.send(("ok", time.process_time()))
                continue
            pipe.send(("ok", getattr(peer, command)(*args)))
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
    finally:
        if peer is not None:
            peer.close()
        pipe.close()


class PeerProcess:
    """A spawned peer and the parent's end of its pipe; every call has a deadline."""

    def __init__(self, ctx: SpawnContext, spec: PeerSpec) -> None:
        self.name = f"{spec.transport}-{spec.role}"
        self.pipe, child = ctx.Pipe()
        self.process = ctx.Process(target=_peer_main, args=(spec, child), name=self.name, daemon=True)
        self.process.start()
        child.close()

    def reply(self, timeout: float = COMMAND_TIMEOUT_S) -> Any:
        if not self.pipe.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer within {timeout:.0f}s")
        status, value = self.pipe.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name} failed:\n{value}")
        return value

    def call(self, command: str, *args: Any) -> Any:
        self.pipe.send((command, args))
        return self.reply()

    def stop(self) -> None:
        try:
            self.pipe.send(("stop", ()))
        except (BrokenPipeError, OSError):
            pass
        self.process.join(10.0)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)


# -- the run ------------------------------------------------------------------------------------
def _start_pairs(
    ctx: SpawnContext,
    transports: tuple[str, ...],
    num_params: int,
    chunk_size: int,
    env: tuple[tuple[str, str], ...],
    tls_dir: str,
) -> dict[str, tuple[PeerProcess, PeerProcess]]:
    """Starts every server, then every client once its server's address is known."""
    procs: list[PeerProcess] = []
    envs = {t: env if t == VARIANT else () for t in transports}
    tls = {t: tls_dir if t.endswith("-tls") else "" for t in transports}
    try:
        servers = {
            t: PeerProcess(ctx, PeerSpec(t, "server", num_params, chunk_size, env=envs[t], tls_dir=tls[t]))
            for t in transports
        }
        procs += servers.values()
        addresses = {t: p.reply(START_TIMEOUT_S) for t, p in servers.items()}
        clients = {
            t: PeerProcess(ctx, PeerSpec(t, "client", num_params, chunk_size, addresses[t], envs[t], tls[t]))
            for t in transports
        }
        procs += clients.values()
        for p in clients.values():
            p.reply(START_TIMEOUT_S)
        return {t: (servers[t], clients[t]) for t in transports}
    except BaseException:
        for p in procs:
            p.stop()
        raise


def measure_size(
    ctx: SpawnContext,
    *,
    num_params: int,
    repeats: int,
    warmup: int,
    chunk_size: int,
    transports: tuple[str, ...],
    env: tuple[tuple[str, str], ...] = (),
    tls_dir: str = "",
) -> tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, list[float]]]]:
    """Seconds per transfer, per transport and direction, and CPU seconds per repetition
    (download and upload together), per transport and side; transports alternate within a
    repetition (``_order``)."""
    pairs = _start_pairs(ctx, transports, num_params, chunk_size, env, tls_dir)
    samples: dict[str, dict[str, list[float]]] = {t: {d: [] for d in DIRECTIONS} for t in transports}
    cpu: dict[str, dict[str, list[float]]] = {t: {"server": [], "client": []} for t in transports}
    try:
        for rep in range(warmup + repeats):
            for transport in _order(transports, rep):
                server, client = pairs[transport]
                cpu0 = server.call("cpu"), client.call("cpu")
                server.call("arm", rep + 1)
                down_s, up_s = client.call("rep", rep + 1)
                server.call("collect")
                cpu1 = server.call("cpu"), client.call("cpu")
                server.call("verify")  # the harness's comparison: not the transport's CPU
                if rep >= warmup:
                    samples[transport]["download"].append(down_s)
                    samples[transport]["upload"].append(up_s)
                    cpu[transport]["server"].append(cpu1[0] - cpu0[0])
                    cpu[transport]["client"].append(cpu1[1] - cpu0[1])
    finally:
        for server, client in pairs.values():
            client.stop()
            server.stop()
    return samples, cpu


def _order(transports: tuple[str, ...], rep: int) -> tuple[str, ...]:
    """Repetition ``rep``'s order: rotated by one every second repetition, and reversed in odd
    ones. A rotation alone keeps the cyclic order, so every transport would always run right
    after the same one (``fedgrid-tls`` after ``fedgrid``), and inherit its after-effects
    (memory it freed, background page reclaim); reversing every second repetition gives
    each transport two different predecessors, and over ``2 * len(transports)`` repetitions
    each goes first twice."""
    shift = (rep // 2) % len(transports)
    order = transports[shift:] + transports[:shift]
    return order[::-1] if rep % 2 else order


def parse_size(text: str) -> int:
    """``10M`` -> 10_000_000 parameters (K, M, G are powers of 1000)."""
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    value = int(float(number) * scale)
    if value < NUM_TENSORS:
        raise argparse.ArgumentTypeError(f"size {text!r}: need at least {NUM_TENSORS} parameters")
    return value


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def run_benchmark(
    *,
    sizes: list[int],
    repeats: int | None,
    warmup: int,
    chunk_size: int,
    transports: tuple[str, ...],
    env: tuple[tuple[str, str], ...] = (),
) -> dict[str, Any]:
    """Runs every size and returns the JSON report (medians, ratios and raw samples)."""
    ctx = mp.get_context("spawn")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fedgrid-bench-certs-") as tmp:
        tls_dir = str(make_certs(Path(tmp) / "certs")) if any(t.endswith("-tls") for t in transports) else ""
        for num_params in sizes:
            rows += _measure_rows(ctx, num_params, repeats, warmup, chunk_size, transports, env, tls_dir)
    return {
        "benchmark": "transport",
        "unit": "MB/s (10^6 payload bytes per second, median over repetitions)",
        "config": {
            "sizes": sizes,
            "repeats": repeats,
            "warmup": warmup,
            "chunk_size": chunk_size,
            "transports": list(transports),
            "fedgrid_env": dict(env),
            "num_tensors": NUM_TENSORS,
            "dtype": "float32",
            "tls": "mutual TLS, EC P-256 certificates of fedgrid.pki"
            if any(t.endswith("-tls") for t in transports)
            else None,
        },
        "environment": {
            "python": platform.python_version(),
            "grpcio": grpc.__version__,
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "rows": rows,
        "summary": {key: _summarize([r[key] for r in rows if r[key] is not None]) for key in RATIOS},
    }


#: The ratios of a row, each (numerator, denominator) transports; ``summary`` has min and geomean of each.
RATIOS = {
    "fedgrid_over_grpc": ("fedgrid", "grpc"),
    "fedgrid_over_socket": ("fedgrid", "socket"),
    "variant_over_grpc": (VARIANT, "grpc"),
    "fedgrid_tls_over_fedgrid": ("fedgrid-tls", "fedgrid"),
    "grpc_tls_over_grpc": ("grpc-tls", "grpc"),
    "fedgrid_tls_over_grpc_tls": ("fedgrid-tls", "grpc-tls"),
}


def _measure_rows(
    ctx: SpawnContext,
    num_params: int,
    repeats: int | None,
    warmup: int,
    chunk_size: int,
    transports: tuple[str, ...],
    env: tuple[tuple[str, str], ...],
    tls_dir: str,
) -> list[dict[str, Any]]:
    """The report's rows of one size: one per direction."""
    reps = repeats if repeats is not None else (5 if num_params < 50_000_000 else 3)
    started = time.perf_counter()
    samples, cpu = measure_size(
        ctx,
        num_params=num_params,
        repeats=reps,
        warmup=warmup,
        chunk_size=chunk_size,
        transports=transports,
        env=env,
        tls_dir=tls_dir,
    )
    nbytes = num_params * 4
    rows: list[dict[str, Any]] = []
    for direction in DIRECTIONS:
        mbps = {t: nbytes / statistics.median(samples[t][direction]) / MB for t in transports}
        rows.append(
            {
                "params": num_params,
                "bytes": nbytes,
                "direction": direction,
                "repeats": reps,
                "mb_per_s": mbps,
                **{key: _ratio(mbps.get(a), mbps.get(b)) for key, (a, b) in RATIOS.items()},
                "seconds": {t: samples[t][direction] for t in transports},
            }
        )
    # CPU per GB moved, a repetition moving the model down and back up (2 * nbytes): less
    # noisy than wall time on a shared machine, and what TLS adds per byte on each side.
    rows[-1]["cpu_s_per_gb"] = rows[-2]["cpu_s_per_gb"] = {
        t: {side: statistics.median(cpu[t][side]) / (2 * nbytes / 1e9) for side in ("server", "client")}
        for t in transports
    }
    print(
        f"  {_fmt_params(num_params)}: {reps} repetitions (+{warmup} warm-up) in {time.perf_counter() - started:.1f}s",
        flush=True,
    )
    return rows


def _summarize(ratios: list[float]) -> dict[str, float] | None:
    return {"min": min(ratios), "geomean": statistics.geometric_mean(ratios)} if ratios else None


def _fmt_params(n: int) -> str:
    for div, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "K")):
        if n >= div and n % div == 0:
            return f"{n // div}{suffix}"
    return str(n)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_report(report: dict[str, Any]) -> None:
    header = f"{'size':>6} {'direction':>9} {'MB':>6} | {'fedgrid MB/s':>12} {'grpc MB/s':>10} {'socket MB/s':>11} | {'fedgrid/grpc':>12} {'fedgrid/socket':>14}"
    print(header)
    print("-" * len(header))
    for r in report["rows"]:
        m = r["mb_per_s"]
        print(
            f"{_fmt_params(r['params']):>6} {r['direction']:>9} {r['bytes'] / MB:>6.0f} | "
            f"{_fmt(m.get('fedgrid'), '.0f'):>12} {_fmt(m.get('grpc'), '.0f'):>10} {_fmt(m.get('socket'), '.0f'):>11} | "
            f"{_fmt(r['fedgrid_over_grpc'], '.2f'):>12} {_fmt(r['fedgrid_over_socket'], '.2f'):>14}"
        )
    if any(VARIANT in r["mb_per_s"] for r in report["rows"]):
        print(f"{VARIANT} ({' '.join(f'{k}={v}' for k, v in report['config']['fedgrid_env'].items())}):")
        for r in report["rows"]:
            print(
                f"{_fmt_params(r['params']):>6} {r['direction']:>9}: {r['mb_per_s'][VARIANT]:.0f} MB/s, {VARIANT}/grpc {_fmt(r['variant_over_grpc'], '.2f')}"
            )
    if any(t in r["mb_per_s"] for r in report["rows"] for t in TLS_TWIN.values()):
        print("mutual TLS:")
        header = (
            f"{'size':>6} {'direction':>9} | {'fedgrid-tls MB/s':>16} {'grpc-tls MB/s':>13} | {'fedgrid-tls/fedgrid':>19} "
            f"{'grpc-tls/grpc':>13} {'fedgrid-tls/grpc-tls':>20}"
        )
        print(header)
        print("-" * len(header))
        for r in report["rows"]:
            m = r["mb_per_s"]
            print(
                f"{_fmt_params(r['params']):>6} {r['direction']:>9} | {_fmt(m.get('fedgrid-tls'), '.0f'):>16} {_fmt(m.get('grpc-tls'), '.0f'):>13} | "
                f"{_fmt(r['fedgrid_tls_over_fedgrid'], '.2f'):>19} {_fmt(r['grpc_tls_over_grpc'], '.2f'):>13} {_fmt(r['fedgrid_tls_over_grpc_tls'], '.2f'):>20}"
            )
    print(
        "CPU seconds per GB moved (median repetition, down and up together; the harness's comparison of the upload is not counted):"
    )
    for r in report["rows"][1::2]:
        print(
            f"{_fmt_params(r['params']):>6}: "
            + ", ".join(
                f"{t} {c['server']:.2f} server + {c['client']:.2f} client"
                for t, c in r["cpu_s_per_gb"].items()
            )
        )
    labels = {
        "fedgrid_over_grpc": "fedgrid/grpc",
        "fedgrid_over_socket": "fedgrid/socket",
        "fedgrid_tls_over_fedgrid": "fedgrid-tls/fedgrid",
        "grpc_tls_over_grpc": "grpc-tls/grpc",
    }
    for key, label in labels.items():
        s = report["summary"][key]
        if s is not None:
            print(f"{label:<19}: min {s['min']:.2f}, geometric mean {s['geomean']:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sizes",
        default="10M,100M",
        help="float32 parameter counts, comma-separated (K/M/G = 10^3/10^6/10^9)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="measured repetitions per size (default 5; 3 from 50M parameters)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured repetitions first (default 1)")
    parser.add_argument(
        "--chunk-size", type=int, default=1 << 20, help="payload bytes per message (default 1 MiB)"
    )
    parser.add_argument(
        "--transports", default=",".join(TRANSPORTS), help=f"subset of {','.join(ALL_TRANSPORTS)}"
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="also run fedgrid and grpc over mutual TLS (fedgrid-tls, grpc-tls), interleaved with the rest",
    )
    parser.add_argument(
        "--fedgrid-env",
        default="",
        help=f"KEY=VALUE,...: also run fedgrid with these environment settings, as '{VARIANT}'",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "transport.json"
    )
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    chosen = {t.strip() for t in args.transports.split(",") if t.strip()}
    if chosen - set(ALL_TRANSPORTS):
        parser.error(
            f"unknown transports {', '.join(sorted(chosen - set(ALL_TRANSPORTS)))}: choose from {', '.join(ALL_TRANSPORTS)}"
        )
    if args.tls:
        chosen |= {TLS_TWIN[t] for t in chosen if t in TLS_TWIN}
    transports = tuple(t for t in ALL_TRANSPORTS if t in chosen)
    env = tuple(tuple(item.split("=", 1)) for item in args.fedgrid_env.split(",") if item.strip())
    if any(len(kv) != 2 for kv in env):
        parser.error("--fedgrid-env takes KEY=VALUE,...")
    if env:
        transports = (
            transports[:1] + (VARIANT,) + transports[1:]
            if "fedgrid" in transports
            else (VARIANT,) + transports
        )
    if not sizes or not transports:
        parser.error("need at least one size and one transport")
    if args.repeats is not None and args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    if not 0 < args.chunk_size <= MAX_MESSAGE_BYTES - 64 * 1024:
        parser.error(
            f"--chunk-size must be in (0, {MAX_MESSAGE_BYTES - 64 * 1024}]: a chunk plus its framing must fit fedgrid's message cap"
        )

    print(
        f"transport benchmark: sizes {', '.join(map(_fmt_params, sizes))}, chunk {args.chunk_size} B, transports {', '.join(transports)}",
        flush=True,
    )
    report = run_benchmark(
        sizes=sizes,
        repeats=args.repeats,
        warmup=args.warmup,
        chunk_size=args.chunk_size,
        transports=transports,
        env=env,
    )  # type: ignore[arg-type]
    print()
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
