"""How many long-polling clients one coordinator holds: Join and health latency and the
coordinator's memory at 1,000, 5,000 and 10,000 connected clients.

Each client is a lightweight protocol client (asyncio, no torch), as the SDK behaves while
it waits for work: Join (transient errors retried), then long polls back to back
(``PollTask``, ``wait_s`` 10 s as the SDK's default), and no heartbeat while a poll is in
flight. Load processes host ``CLIENTS_PER_PROCESS`` clients each, ``CLIENTS_PER_CHANNEL`` per
connection, in processes separate from the coordinator; the clients ramp up level by level.
At each level, once every client joined and had a poll held and answered, this process times sequential
Join and health-check calls (``--calls``, 5 s deadline each) while the clients hold their
next polls and reads the coordinator's
``VmRSS`` and ``VmHWM`` from ``/proc``; the load processes report the polls that failed.
A server whose timed Joins all time out at a level is not taken to the next.

Servers, side by side in one run (the same levels, one after the other):

- ``ours``: the coordinator of this checkout (``grpc.aio``);
- ``threaded``: a recorded revision (``--baseline REV``, default the last threaded one),
  checked out with ``git worktree`` and imported from its own tree.

    python benchmarks/many_clients.py                        # about 5 minutes on 2 cores
    python benchmarks/many_clients.py --levels 1000,2000 --servers ours
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from idle_streams import DEADLINE_S, time_calls, worktree_import_tree  # noqa: E402

#: Clients one load process hosts, and how many share one connection.
CLIENTS_PER_PROCESS = 1000
CLIENTS_PER_CHANNEL = 100
#: Joins one load process has in flight at once while it ramps up.
JOIN_CONCURRENCY = 50
#: Longest wait for a level's clients to join and have a poll answered; then it is timed as it is.
RAMP_TIMEOUT_S = 120.0

SERVER = """
import sys
from datetime import timedelta
from fedgrid.server.serve import Coordinator
from fedgrid.server.remote_fleet import RemoteFleet
fleet = RemoteFleet()
server = Coordinator("127.0.0.1:0", fleet, max_workers=256).start()
print(server.port, flush=True)
sys.stdin.read()
"""

LOADER = """
import asyncio, json, sys, time
import grpc
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc
from fedgrid.proto.tls import session_metadata

PORT, FIRST, COUNT, PER_CHANNEL, CONCURRENCY = (int(a) for a in sys.argv[1:6])
stats = {"joined": 0, "join_errors": 0, "holding": 0, "served": 0, "polls": 0, "poll_errors": 0}
errors = {}

async def client(stub, name, gate):
    async with gate:
        for attempt in range(8):
            try:
                join = await stub.Join(pb.JoinRequest(name=name, num_examples=1), timeout=60)
                break
            except grpc.aio.AioRpcError as exc:
                if attempt == 7:
                    stats["join_errors"] += 1
                    return
                await asyncio.sleep(0.2 * 2 ** attempt)
    stats["joined"] += 1
    request = pb.PollRequest(client_id=join.client_id, wait_s=10)
    md = session_metadata(join.session_token)
    held = served = False
    while True:
        if not held:
            stats["holding"] += 1
            held = True
        try:
            await stub.PollTask(request, metadata=md, timeout=40)
            stats["polls"] += 1
            if not served:  # the server held its poll and answered it
                stats["served"] += 1
                served = True
        except grpc.aio.AioRpcError as exc:
            stats["poll_errors"] += 1
            key = f"{exc.code().name}: {(exc.details() or '')[:60]}"
            errors[key] = errors.get(key, 0) + 1
            stats["holding"] -= 1
            held = False
            await asyncio.sleep(1.0)

async def main():
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{PORT}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range((COUNT + PER_CHANNEL - 1) // PER_CHANNEL)]
    stubs = [pb_grpc.CoordinatorStub(c) for c in channels]
    gate = asyncio.Semaphore(CONCURRENCY)
    tasks = [asyncio.ensure_future(client(stubs[i // PER_CHANNEL], f"h{FIRST + i:06d}", gate)) for i in range(COUNT)]
    loop = asyncio.get_running_loop()
    while True:  # one status line per request on stdin; EOF ends the run
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        print(json.dumps({**stats, "errors": errors}), flush=True)
    for t in tasks:
        t.cancel()

asyncio.run(main())
"""


def _memory(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024 / 1e6  # MB
    return {"rss_mb": fields["VmRSS"], "peak_rss_mb": fields["VmHWM"]}


class Loader:
    def __init__(self, ours: Path, port: int, first: int, count: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(ours)}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                LOADER,
                str(port),
                str(first),
                str(count),
                str(CLIENTS_PER_CHANNEL),
                str(JOIN_CONCURRENCY),
            ],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def status(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("status\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"load process exited with {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _total(loaders: list[Loader]) -> dict[str, Any]:
    total: dict[str, Any] = {
        "joined": 0,
        "join_errors": 0,
        "holding": 0,
        "served": 0,
        "polls": 0,
        "poll_errors": 0,
        "errors": {},
    }
    for loader in loaders:
        s = loader.status()
        for k in ("joined", "join_errors", "holding", "served", "polls", "poll_errors"):
            total[k] += s[k]
        for code, n in s["errors"].items():
            total["errors"][code] = total["errors"].get(code, 0) + n
    return total


def run_server(name: str, tree: Path, ours: Path, levels: list[int], calls: int) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER],
        cwd=tree,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    loaders: list[Loader] = []
    rows = []
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        started = 0
        for level in levels:
            while started < level:
                count = min(CLIENTS_PER_PROCESS, level - started)
                loaders.append(Loader(ours, port, started, count))
                started += count
            t0 = time.monotonic()
            while True:  # every client joined and had a long poll held and answered, or the level gives up
                total = _total(loaders)
                ready = total["joined"] + total["join_errors"] >= level and total["served"] >= total["joined"]
                if ready or time.monotonic() - t0 > RAMP_TIMEOUT_S:
                    break
                time.sleep(1.0)
            ramp_s = time.monotonic() - t0
            before = _total(loaders)
            timed = time_calls(port, calls)
            after = _total(loaders)
            row = {
                "server": name,
                "clients": level,
                "joined": after["joined"],
                "join_errors": after["join_errors"],
                "holding": after["holding"],
                "served": after["served"],
                "ramp_s": round(ramp_s, 1),
                "poll_errors_while_timing": after["poll_errors"] - before["poll_errors"],
                "poll_errors": after["poll_errors"],
                "errors": after["errors"],
                **_memory(server.pid),
                **{f"{k}_{m}": v for k, r in timed.items() for m, v in r.items()},
            }
            rows.append(row)
            print(
                f"{name:>9} {level:>6} clients | joined {row['joined']:>6} served {row['served']:>6} (ramp {ramp_s:5.1f} s) |"
                f" join p50 {row['join_p50_ms']:7.1f} p99 {row['join_p99_ms']:7.1f} ms fail {row['join_failed']:3d} |"
                f" health p50 {row['health_p50_ms']:7.1f} p99 {row['health_p99_ms']:7.1f} ms fail {row['health_failed']:3d} |"
                f" RSS {row['rss_mb']:7.0f} MB (peak {row['peak_rss_mb']:7.0f}) | poll errors {row['poll_errors']}",
                flush=True,
            )
            if row["join_failed"] == calls:  # stalled: more clients would only take longer to say so
                print(f"{name:>9} stalled at {level} clients: higher levels skipped", flush=True)
                break
    finally:
        for loader in loaders:
            loader.close()
        server.kill()
        server.wait()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--levels", default="1000,5000,10000", help="connected clients, increasing, comma-separated"
    )
    parser.add_argument("--calls", type=int, default=200, help="timed calls of each kind per level")
    parser.add_argument("--servers", default="ours,threaded", help="which servers to run (ours, threaded)")
    parser.add_argument("--baseline", default="0e85252", help="the threaded revision to compare with")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "many_clients.json")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.levels.split(",") if c]
    servers = [s for s in args.servers.split(",") if s]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ours = worktree_import_tree(None, work)
        try:
            trees = {
                "ours": ours,
                **({"threaded": worktree_import_tree(args.baseline, work)} if "threaded" in servers else {}),
            }
            for name in servers:
                rows += run_server(name, trees[name], ours, levels, args.calls)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "checkout")],
                capture_output=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "calls": args.calls,
                "deadline_s": DEADLINE_S,
                "machine": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
