"""Integration-test harness: real processes and real gRPC servers on ephemeral ports.

The ``fedgrid`` processes start from the tests' zygote (``zygote.popen``: forked from a process
that has imported torch and the rest once, or a real process when a fork would differ).

Every process a test starts pins ``THREADS`` intra-op threads (``--threads``), and every
in-process reference a test compares bitwise with them runs with the same count
(``REFERENCE``): float results depend on the thread count (``fedgrid.determinism``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path
from typing import Callable

import grpc
import torch

from fedgrid.clock import MONOTONIC, Clock
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator

import zygote

FEDGRID = [sys.executable, "-m", "fedgrid.cli"]
#: Intra-op threads of every fedgrid process the tests start (one: the machines have two
#: cores and a test runs several processes at once).
THREADS = 1
#: Config overrides for an in-process run that must equal those processes bit for bit.
REFERENCE = {"threads": THREADS, "engine": "sequential"}


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
    # A client's backoff between retries is capped at 1 s, not 10: the tests restart a
    # coordinator within seconds, and a client waiting out a long backoff after a restart idles
    # the test (one once missed a whole resumed run, test_quorum_crash).
    env.setdefault("FEDGRID_RETRY_MAX_WAIT_S", "1")
    apps = str(Path(__file__).parent / "apps")  # user apps for --app / --model
    env["PYTHONPATH"] = os.pathsep.join(p for p in (apps, env.get("PYTHONPATH", "")) if p)
    return env


def start_coordinator(
    out: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """Starts ``fedgrid coordinator`` on port 0 (``env``: extra environment variables) and
    returns it with its address."""
    log = open(out.parent / f"{out.name}.coordinator.log", "w")
    proc = zygote.popen(
        [
            *FEDGRID,
            "coordinator",
            "--listen",
            "127.0.0.1:0",
            "--out",
            str(out),
            "--threads",
            str(THREADS),
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**child_env(), **(env or {})},
    )
    address_file = out / "address"
    wait_until(
        lambda: address_file.exists() and address_file.read_text().strip() != "" or proc.poll() is not None,
        timeout=60,
        what="coordinator address",
    )
    assert proc.poll() is None, (
        f"coordinator exited early: {(out.parent / f'{out.name}.coordinator.log').read_text()}"
    )
    return proc, address_file.read_text().strip()


def start_client(address: str, log_path: Path, *args: str) -> subprocess.Popen:
    return zygote.popen(
        [*FEDGRID, "client", "--coordinator", address, "--threads", str(THREADS), *args],
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        env=child_env(),
    )


class InProcessCoordinator:
    """A real gRPC coordinator in this process (for direct access to its state); ``clock``: the
    fleet's (a test's ``ManualClock`` decides its deadlines, grace windows and silence)."""

    def __init__(
        self,
        state: "OrderedDict[str, torch.Tensor]",
        *,
        heartbeat_s: float = 60.0,
        interceptors=(),
        bounds=None,
        clock: Clock = MONOTONIC,
        codec_policy=None,
        **coordinator_options,
    ) -> None:
        self.fleet = RemoteFleet(
            heartbeat_interval=timedelta(seconds=heartbeat_s),
            bounds=bounds,
            clock=clock,
            codec_policy=codec_policy,
        )
        self.coordinator = Coordinator(
            "127.0.0.1:0", self.fleet, max_workers=16, interceptors=interceptors, **coordinator_options
        ).start()
        self.address = self.coordinator.address
        self.state = state
        self.outcome = None
        self._thread: threading.Thread | None = None

    def open_round(
        self,
        *,
        min_clients: int = 1,
        server_round: int = 1,
        timeout_s: float = 60.0,
        target: int | None = None,
    ) -> None:
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
        wait_until(
            lambda: (r := self.fleet.current_round) is not None and r.server_round == server_round,
            timeout=10,
            what="round to open",
        )

    def wait_round(self, timeout: float = 60.0):
        assert self._thread is not None
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "round did not close"
        return self.outcome

    def stop(self) -> None:
        self.coordinator.stop(grace=0.5)
        self.fleet.close()


class FailFirst(grpc.aio.ServerInterceptor):
    """Fault injection: the first ``times`` calls of ``method`` (a unary method) end with ``code``."""

    def __init__(self, method: str, code: grpc.StatusCode, times: int) -> None:
        self.method, self.code, self.times = method, code, times
        self.calls = 0
        self._lock = threading.Lock()

    async def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.endswith("/" + self.method):
            return await continuation(handler_call_details)
        with self._lock:
            self.calls += 1
            fail = self.calls <= self.times
        if not fail:
            return await continuation(handler_call_details)
        code = self.code

        async def abort(request, context):
            await context.abort(code, f"injected {code.name}")

        return grpc.unary_unary_rpc_method_handler(abort)


class CoordinatorRun:
    """One coordinator process on port 0 (``apps/event_coordinator.py``: ``fedgrid coordinator``
    printing each event it emits, see ``fedgrid.events``), whose events are read as they happen.

    With ``trigger = (round, event)`` the process sends itself ``sig`` the first time
    ``event`` happens for a round at or after ``round``, synchronously, from inside the
    coordinator: fault injection keyed on the coordinator's documented events, not on its
    log text, and landing inside the phase the event opens rather than some time after it.

    Args:
        out: the run directory (``--out``); a restart passes the same one.
        args: further coordinator flags.
        log_path: the process's log (stderr) and other output are appended here.
        env: extra environment variables (``apps/event_coordinator.py``'s ``SLOW_EVAL_S``).
    """

    def __init__(
        self,
        out: Path,
        args: list[str],
        log_path: Path,
        *,
        trigger: tuple[int, str] | None = None,
        sig: int | str = signal.SIGKILL,
        env: dict[str, str] | None = None,
    ) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        (out / "address").unlink(missing_ok=True)
        self.events: list[dict] = []
        self.trigger, self.sig = trigger, sig
        self.killed = threading.Event()
        self.log = open(log_path, "a")
        flags = ["--listen", "127.0.0.1:0", "--out", str(out), "--threads", str(THREADS), *args]
        name = sig if isinstance(sig, str) else signal.Signals(sig).name  # or "ENOSPC": a full disk
        fault = [] if trigger is None else [str(trigger[0]), trigger[1], name]
        command = [
            sys.executable,
            str(Path(__file__).parent / "apps" / "event_coordinator.py"),
            *fault,
            "--",
            *flags,
        ]
        self.proc = zygote.popen(
            command, stdout=subprocess.PIPE, stderr=self.log, text=True, env={**child_env(), **(env or {})}
        )
        self._lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # blocking reads: each event as soon as it is printed
            if line.startswith("EVENT "):
                self._on_event(json.loads(line[len("EVENT ") :]))
            else:
                self.log.write(line)
                self.log.flush()

    def _on_event(self, event: dict) -> None:
        with self._lock:
            self.events.append(event)
        if self.trigger is None or self.killed.is_set():
            return
        server_round, name = self.trigger
        # The first time the event happens at or after the chosen round (a redone round
        # may skip one: its updates are restored, not uploaded again): the process has
        # signalled itself right after printing it.
        if event["event"] == name and event.get("round", 0) >= server_round:
            self.killed.set()

    def seen(self, name: str, **fields: object) -> list[dict]:
        """The events named ``name`` so far (all of them once the process has exited) whose
        fields include ``fields``."""
        if self.proc.poll() is not None:
            self.reader.join(timeout=30)  # the pipe is drained up to the last event
        with self._lock:
            return [
                e for e in self.events if e["event"] == name and all(e.get(k) == v for k, v in fields.items())
            ]

    def address(self, timeout: float = 60) -> str:
        """The address this start listens on (waits for ``RUN_DIR/address``)."""
        path = self.out / "address"
        wait_until(
            lambda: path.exists() or self.proc.poll() is not None, timeout=timeout, what="coordinator address"
        )
        assert path.exists(), f"coordinator exited early with {self.proc.returncode}"
        return path.read_text().strip()


#: The reference deployment the parity, crash and shutdown tests share (``reference_deployment``):
#: a coordinator and CLIENTS client processes, uninterrupted, ROUNDS rounds from SEED.
REFERENCE_ROUNDS, REFERENCE_CLIENTS, REFERENCE_SEED = 10, 3, 11
REFERENCE_ARGS = [
    "--rounds",
    str(REFERENCE_ROUNDS),
    "--min-clients",
    str(REFERENCE_CLIENTS),
    "--seed",
    str(REFERENCE_SEED),
    "--heartbeat-interval-s",
    "2",
]


def deploy(tmp_path: Path, name: str, coordinator_args: list[str], *, clients: int, seed: int) -> Path:
    """An uninterrupted coordinator with ``clients`` client processes (the same processes,
    flags and thread count as the tests' fault-injected runs); returns its run directory."""
    out = tmp_path / name
    run = CoordinatorRun(out, coordinator_args, tmp_path / f"{name}.coordinator.log")
    address = run.address()
    procs = [
        start_client(
            address, tmp_path / f"{name}.client{i}.log", "--partition", f"{i}/{clients}", "--seed", str(seed)
        )
        for i in range(clients)
    ]
    try:
        assert run.proc.wait(timeout=240) == 0, (tmp_path / f"{name}.coordinator.log").read_text()[-3000:]
        for i, c in enumerate(procs):
            assert c.wait(timeout=60) == 0, (tmp_path / f"{name}.client{i}.log").read_text()[-3000:]
    finally:
        for p in [run.proc, *procs]:
            if p.poll() is None:
                p.kill()
    return out


def assert_same_model(a: Path, b: Path) -> None:
    """The two runs' final models hold the same tensors, bit for bit."""
    from fedgrid.runlog import load_model

    left, right = load_model(a / "model.safetensors"), load_model(b / "model.safetensors")
    assert set(left) == set(right)
    for name, tensor in left.items():
        assert torch.equal(tensor, right[name]), name


class Relay:
    """A TCP relay in front of a server: a fixed front address for clients while the server
    behind it restarts on new ports, and a way to cut connections mid-stream.

    ``retarget(port)`` sends new connections to ``port`` (``None``: refuse them, as a
    server that is down would); ``cut()`` drops every open connection; ``upstream_bytes``
    counts what clients sent through it.
    """

    def __init__(self, target_port: int | None) -> None:
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
            port = self.target_port
            try:
                if port is None:
                    raise ConnectionRefusedError("no server behind the relay")
                upstream = socket.create_connection(("127.0.0.1", port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()  # the client sees the connection fail and retries
                continue
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

    def retarget(self, port: int | None) -> None:
        self.target_port = port

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
