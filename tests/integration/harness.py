"""Integration-test harness: real processes and real gRPC servers on ephemeral ports."""

from __future__ import annotations

import os
import re
import socket
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator

import grpc
import torch

from fedgrid.server.app import Coordinator
from fedgrid.server.grpc_fleet import GrpcFleet

FEDGRID = [sys.executable, "-m", "fedgrid.cli"]


def wait_until(condition: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.05) -> None:
    """Polls ``condition`` until it holds; fails the test naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    apps = str(Path(__file__).parent / "apps")  # user apps for --app / --model
    env["PYTHONPATH"] = os.pathsep.join(p for p in (apps, env.get("PYTHONPATH", "")) if p)
    return env


def start_coordinator(out: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """Starts ``fedgrid coordinator`` on port 0 and returns it with its address."""
    log = open(out.parent / f"{out.name}.coordinator.log", "w")
    proc = subprocess.Popen(
        [*FEDGRID, "coordinator", "--listen", "127.0.0.1:0", "--out", str(out), *args],
        stdout=log, stderr=subprocess.STDOUT, env=child_env(),
    )
    address_file = out / "address"
    wait_until(lambda: address_file.exists() and address_file.read_text().strip() != "" or proc.poll() is not None, timeout=60, what="coordinator address")
    assert proc.poll() is None, f"coordinator exited early: {(out.parent / f'{out.name}.coordinator.log').read_text()}"
    return proc, address_file.read_text().strip()


def start_client(address: str, log_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*FEDGRID, "client", "--coordinator", address, *args],
        stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=child_env(),
    )


class InProcessCoordinator:
    """A real gRPC coordinator in this process (for direct access to its state)."""

    def __init__(self, state: "OrderedDict[str, torch.Tensor]", *, heartbeat_s: float = 60.0, interceptors=()) -> None:
        self.fleet = GrpcFleet(heartbeat_interval=timedelta(seconds=heartbeat_s))
        self.coordinator = Coordinator("127.0.0.1:0", self.fleet, max_workers=16, interceptors=interceptors).start()
        self.address = self.coordinator.address
        self.state = state
        self.outcome = None
        self._thread: threading.Thread | None = None

    def open_round(self, *, min_clients: int = 1, server_round: int = 1, timeout_s: float = 60.0, target: int | None = None) -> None:
        """Runs one round in a background thread over the clients that joined."""
        from fedgrid.types import FitIns

        infos = self.fleet.wait_for_clients(min_clients=min_clients, timeout=timedelta(seconds=30))

        def run_round() -> None:
            self.outcome = self.fleet.fit_round(
                server_round=server_round,
                global_state=self.state,
                assignments=[(info, FitIns(round=server_round)) for info in infos],
                timeout=timedelta(seconds=timeout_s),
                target=target,
            )

        self._thread = threading.Thread(target=run_round, daemon=True)
        self._thread.start()
        wait_until(lambda: self.fleet._round is not None and self.fleet._round.server_round == server_round, timeout=10, what="round to open")

    def wait_round(self, timeout: float = 60.0):
        assert self._thread is not None
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "round did not close"
        return self.outcome

    def stop(self) -> None:
        self.coordinator.stop(grace=0.5)
        self.fleet.close()


class FailFirst(grpc.ServerInterceptor):
    """Fault injection: the first ``times`` calls of ``method`` end with ``code``."""

    def __init__(self, method: str, code: grpc.StatusCode, times: int) -> None:
        self.method, self.code, self.times = method, code, times
        self.calls = 0
        self._lock = threading.Lock()

    def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.endswith("/" + self.method):
            return continuation(handler_call_details)
        with self._lock:
            self.calls += 1
            fail = self.calls <= self.times
        if not fail:
            return continuation(handler_call_details)
        code = self.code

        def abort(request, context):
            context.abort(code, f"injected {code.name}")

        return grpc.unary_unary_rpc_method_handler(abort)


class CoordinatorRun:
    """One coordinator process whose log is watched line by line.

    ``trigger = (round, text)`` SIGKILLs it the first time a log line says
    ``round N: text`` with N at or after ``round``.
    """

    def __init__(self, args: list[str], log_path) -> None:
        self.lines: list[str] = []
        self.log = open(log_path, "a")
        self.proc = subprocess.Popen([*FEDGRID, "coordinator", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
        self.trigger: tuple[int, str] | None = None
        self.killed = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            self.lines.append(line)
            if self.trigger is not None and not self.killed.is_set():
                server_round, phase = self.trigger
                # The first time the phase happens at or after the chosen round (a redone
                # round may skip a phase: its updates are restored, not uploaded again).
                m = re.search(r"round (\d+): " + phase, line)
                if m and int(m.group(1)) >= server_round:
                    self.proc.send_signal(signal.SIGKILL)  # at once, mid-phase
                    self.killed.set()


class Relay:
    """A TCP relay in front of a server, for cutting connections mid-stream (fault injection).

    ``cut()`` drops every open connection; new connections are relayed as before.
    ``upstream_bytes`` counts what clients sent through it.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.upstream_bytes = 0
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
                if count:
                    with self._lock:
                        self.upstream_bytes += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        self.cut()
