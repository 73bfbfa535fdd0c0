"""What a Join costs with the connection's handshake included: plaintext and mutual TLS side by side.

Two coordinators run in processes of their own, one plaintext and one speaking mutual TLS
with certificates made once per run by ``fedgrid.pki`` in a temporary directory (a CA, a
server certificate for 127.0.0.1, a client certificate). This process times sequential
Joins against both, ``--calls`` of each kind, the kinds and servers interleaved call by
call (the order rotates), each call with a 5 s deadline:

- ``fresh``: a new channel (the SDK's channel options, its own connection), then Join:
  TCP connect, the TLS handshake with both certificates checked, HTTP/2 setup and the call.
  The credentials object is built once per server, as a long-lived client would.
- ``warm``: a Join on a channel that is already connected: the call alone.
- ``sdk``: what a client program pays from nothing: ``Connection(target, tls=...)`` (which
  also reads and checks its PEM files) and ``Connection.join``.

Every Join replaces the previous session of the same name (plaintext joins as ``probe``,
TLS as its certificate's identity, ``probe``), so both servers do the same work. It prints
p50 and p99 in ms and the CPU each call costs this process (``time.process_time``) and the
server (its threads' ``/proc/PID/task/*/schedstat``), means over the calls, and writes JSON.

    python benchmarks/handshake.py                      # 200 calls of each kind, about a minute
    python benchmarks/handshake.py --calls 50 --out /tmp/handshake.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from transport import CLIENT_CERT, SERVER_CERT, make_certs  # noqa: E402

__all__ = ["main", "measure"]

SERVER = """
import sys
from datetime import timedelta
from fedgrid.proto.tls import TLSFiles
from fedgrid.server.serve import Coordinator
from fedgrid.server.remote_fleet import RemoteFleet
tls = TLSFiles(*sys.argv[1:4]) if len(sys.argv) > 1 else None
fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=600))
server = Coordinator("127.0.0.1:0", fleet, tls=tls).start()
print(server.port, flush=True)
sys.stdin.read()
"""

#: Deadline of one Join (and of a server's start).
DEADLINE_S = 5.0
START_TIMEOUT_S = 60.0
KINDS = ("fresh", "warm", "sdk")
SERVERS = ("plaintext", "mtls")
#: Unmeasured calls of each scenario first (imports, first connections).
WARMUP = 10


def _cpu_s(pid: int) -> float:
    """CPU time of process ``pid`` so far, seconds: the sum of its threads' run time
    (``/proc/PID/task/*/schedstat``, nanoseconds; ``/proc/PID/stat`` counts 10 ms ticks)."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[0])
        except (OSError, IndexError, ValueError):  # a thread that just ended
            pass
    return total / 1e9


class Server:
    """A coordinator in a subprocess; ``tls``: its (CA, cert, key) paths or ``None``."""

    def __init__(self, tls: tuple[Path, Path, Path] | None) -> None:
        args = [str(p) for p in tls] if tls else []
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line = self._readline(START_TIMEOUT_S)
        self.address = f"127.0.0.1:{int(line)}"

    def _readline(self, timeout: float) -> str:
        import selectors

        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise TimeoutError(f"coordinator did not start within {timeout:.0f}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"coordinator exited with {self.proc.wait()}")
        return line

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _scenarios(
    servers: dict[str, Server], certs: Path
) -> tuple[dict[tuple[str, str], Callable[[], Callable[[], None]]], list[Any]]:
    """One Join callable per (server, kind), and the warm channels to close at the end. A
    callable returns what closes its connection, which the caller runs outside the timed window."""
    from fedgrid.client.api import Client
    from fedgrid.client.runtime import GRPC_OPTIONS, Connection
    from fedgrid.proto import fedgrid_pb2 as pb
    from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc
    from fedgrid.proto.tls import TLSFiles, channel_credentials

    class Probe(Client):
        name = "probe"

        def fit(self, state, ins):  # type: ignore[no-untyped-def]
            raise AssertionError("the benchmark never trains")

    client_files = TLSFiles(
        str(certs / "ca.pem"), str(certs / f"{CLIENT_CERT}.pem"), str(certs / f"{CLIENT_CERT}.key")
    )
    credentials = channel_credentials(client_files)
    probe = Probe()
    out: dict[tuple[str, str], Callable[[], Callable[[], None]]] = {}
    warm_channels = []
    for name, server in servers.items():
        tls = name == "mtls"
        request = pb.JoinRequest(
            name="" if tls else "probe", num_examples=1
        )  # under mTLS the certificate names it

        def channel(address: str = server.address, tls: bool = tls) -> grpc.Channel:
            if tls:
                return grpc.secure_channel(address, credentials, options=GRPC_OPTIONS)
            return grpc.insecure_channel(address, options=GRPC_OPTIONS)

        def fresh(
            channel: Callable[[], grpc.Channel] = channel, request: Any = request
        ) -> Callable[[], None]:
            ch = channel()
            try:
                pb_grpc.CoordinatorStub(ch).Join(request, timeout=DEADLINE_S)
            except BaseException:
                ch.close()
                raise
            return ch.close

        warm_channel = channel()
        warm_channels.append(warm_channel)
        warm_stub = pb_grpc.CoordinatorStub(warm_channel)

        def warm(stub: Any = warm_stub, request: Any = request) -> Callable[[], None]:
            stub.Join(request, timeout=DEADLINE_S)
            return lambda: None

        def sdk(address: str = server.address, tls: bool = tls) -> Callable[[], None]:
            conn = Connection(
                address, tls=client_files if tls else None, rpc_timeout=DEADLINE_S, retry_max_elapsed=0.0
            )
            try:
                conn.join(probe)
            except BaseException:
                conn.close()
                raise
            return conn.close

        out.update({(name, "fresh"): fresh, (name, "warm"): warm, (name, "sdk"): sdk})
    return out, warm_channels


def _stats(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {
        "p50_ms": 1e3 * statistics.median(times),
        "p99_ms": 1e3 * times[min(len(times) - 1, int(0.99 * len(times)))],
        "mean_ms": 1e3 * statistics.fmean(times),
    }


def measure(calls: int) -> list[dict[str, Any]]:
    """Runs both coordinators and every scenario ``calls`` times (plus ``WARMUP``); one row per scenario."""
    with tempfile.TemporaryDirectory(prefix="fedgrid-bench-certs-") as tmp:
        certs = make_certs(Path(tmp) / "certs")
        pems = (certs / "ca.pem", certs / f"{SERVER_CERT}.pem", certs / f"{SERVER_CERT}.key")
        servers: dict[str, Server] = {}
        warm_channels: list[Any] = []
        try:
            for name in SERVERS:
                servers[name] = Server(pems if name == "mtls" else None)
            scenarios, warm_channels = _scenarios(servers, certs)
            order = list(scenarios)
            times: dict[tuple[str, str], list[float]] = {k: [] for k in order}
            cpu_client = {k: 0.0 for k in order}
            cpu_server = {k: 0.0 for k in order}
            failed = {k: 0 for k in order}
            for i in range(WARMUP + calls):
                shift = i % len(order)  # rotate who goes first, so no scenario always follows another
                for key in order[shift:] + order[:shift]:
                    pid = servers[key[0]].proc.pid
                    s0, c0, t0 = _cpu_s(pid), time.process_time(), time.perf_counter()
                    try:
                        close = scenarios[key]()
                        elapsed = time.perf_counter() - t0
                        ok = True
                        close()  # outside the timed window, inside the CPU one: a connection's teardown is its cost
                    except (
                        Exception
                    ) as exc:  # grpc.RpcError, RpcFailed: counted as the deadline, reported below
                        elapsed, ok = DEADLINE_S, False
                        if i < WARMUP:
                            raise RuntimeError(f"{key}: {exc}") from exc
                    c1, s1 = time.process_time(), _cpu_s(pid)
                    if i >= WARMUP:
                        times[key].append(elapsed)
                        cpu_client[key] += c1 - c0
                        cpu_server[key] += s1 - s0
                        failed[key] += not ok
        finally:
            for ch in warm_channels:
                ch.close()
            for server in servers.values():
                server.close()
    return [
        {
            "server": server,
            "kind": kind,
            "calls": calls,
            **_stats(times[(server, kind)]),
            "failed": failed[(server, kind)],
            "client_cpu_ms": 1e3 * cpu_client[(server, kind)] / calls,
            "server_cpu_ms": 1e3 * cpu_server[(server, kind)] / calls,
        }
        for server, kind in order
    ]


def print_report(rows: list[dict[str, Any]]) -> None:
    by = {(r["server"], r["kind"]): r for r in rows}
    header = (
        f"{'kind':>6} {'server':>10} | {'p50 ms':>7} {'p99 ms':>7} {'mean ms':>7} | {'client CPU ms':>13} {'server CPU ms':>13} | "
        f"{'failed':>6} | {'p50 mtls/plain':>14}"
    )
    print(header)
    print("-" * len(header))
    for kind in KINDS:
        for server in SERVERS:
            r = by[(server, kind)]
            ratio = r["p50_ms"] / by[("plaintext", kind)]["p50_ms"]
            print(
                f"{kind:>6} {server:>10} | {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {r['mean_ms']:>7.2f} | {r['client_cpu_ms']:>13.2f} "
                f"{r['server_cpu_ms']:>13.2f} | {r['failed']:>6} | {ratio if server == 'mtls' else 1.0:>14.2f}"
            )
    for server in SERVERS:
        extra = by[(server, "fresh")]["p50_ms"] - by[(server, "warm")]["p50_ms"]
        print(f"{server}: a fresh connection adds {extra:.2f} ms to a Join (p50 fresh - p50 warm)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--calls", type=int, default=200, help="timed Joins of each kind against each server (default 200)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "handshake.json")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error("--calls must be >= 1")
    started = time.perf_counter()
    rows = measure(args.calls)
    print(
        f"{args.calls} Joins of each kind per server (+{WARMUP} warm-up), interleaved, in {time.perf_counter() - started:.1f}s"
    )
    print_report(rows)
    report = {
        "benchmark": "handshake",
        "calls": args.calls,
        "warmup": WARMUP,
        "deadline_s": DEADLINE_S,
        "tls": "mutual TLS, EC P-256 certificates of fedgrid.pki, no session resumption",
        "environment": {
            "python": platform.python_version(),
            "grpcio": grpc.__version__,
            "cpus": os.cpu_count(),
            "machine": platform.processor() or platform.machine(),
            "platform": platform.platform(),
        },
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
