"""Join and health-check latency while idle upload streams are held open on the coordinator.

An idle stream is an ``UploadUpdate`` call that is opened and never sends a message (a
broken or hostile client). For each server and each count of idle streams, one process
opens the streams (asyncio, 100 per channel), and this process then times sequential Join
and health-check calls against the same coordinator, each with a 5 s deadline (a call that
times out counts as 5 s and as a failure; after 3 time-outs in a row the remaining calls of
that kind are counted as time-outs without being made). The servers, side by side in one run:

- ``ours``: the coordinator of this checkout (``grpc.aio``);
- ``threaded``: a recorded revision (``--baseline REV``, default the last threaded one),
  checked out with ``git worktree`` and imported from its own tree.

    python benchmarks/idle_streams.py                    # about 2 minutes on 2 cores
    python benchmarks/idle_streams.py --streams 0,260,1000 --calls 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "tools"))
from import_tree import build  # noqa: E402

SERVER = """
import sys, threading
from datetime import timedelta
from fedgrid.server.serve import Coordinator
from fedgrid.server.remote_fleet import RemoteFleet
fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=600))
server = Coordinator("127.0.0.1:0", fleet, max_workers=256).start()
print(server.port, flush=True)
sys.stdin.read()
"""

OPENER = """
import asyncio, sys
import grpc

async def main(port, n):
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range((n + 99) // 100)]
    never = asyncio.Event()

    async def nothing():
        await never.wait()
        yield b""

    calls = []
    for i in range(n):
        method = channels[i // 100].stream_unary("/fedgrid.v1.Coordinator/UploadUpdate", request_serializer=None, response_deserializer=None)
        calls.append(method(nothing()))
    await asyncio.sleep(3.0)  # let the streams reach the server
    print("open", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for c in calls:
        c.cancel()

asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
"""

DEADLINE_S = 5.0
#: Consecutive time-outs after which the rest of a scenario's calls count as time-outs too.
GIVE_UP_AFTER = 3


def worktree_import_tree(rev: str | None, work: Path) -> Path:
    """An import tree of this checkout (``rev`` None) or of ``rev`` (a git worktree)."""
    if rev is None:
        return build(work / "ours")
    checkout = work / "checkout"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(checkout), rev],
        check=True,
        capture_output=True,
    )
    return build(work / "threaded", root=checkout)


def time_calls(port: int, calls: int) -> dict[str, dict[str, float]]:
    """p50 / p99 (ms) and failures of ``calls`` sequential Joins (each a new client name)
    and health checks against the coordinator on ``port``, ``DEADLINE_S`` each."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    sys.path.insert(0, str(ROOT))
    from fedgrid.proto import fedgrid_pb2 as pb
    from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc

    out = {}
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub, health = pb_grpc.CoordinatorStub(channel), health_pb2_grpc.HealthStub(channel)
        kinds = {
            "join": lambda i: stub.Join(
                pb.JoinRequest(name=f"probe-{time.monotonic_ns()}-{i}", num_examples=1), timeout=DEADLINE_S
            ),
            "health": lambda i: health.Check(
                health_pb2.HealthCheckRequest(service="fedgrid.v1.Coordinator"), timeout=DEADLINE_S
            ),
        }
        for kind, call in kinds.items():
            times, failed, streak = [], 0, 0
            for i in range(calls):
                if streak >= GIVE_UP_AFTER:  # the server is stalled: the remaining calls would time out too
                    failed += calls - i
                    times += [DEADLINE_S] * (calls - i)
                    break
                t0 = time.perf_counter()
                try:
                    call(i)
                    times.append(time.perf_counter() - t0)
                    streak = 0
                except grpc.RpcError:
                    failed += 1
                    streak += 1
                    times.append(DEADLINE_S)
            times.sort()
            out[kind] = {
                "p50_ms": 1e3 * statistics.median(times),
                "p99_ms": 1e3 * times[min(len(times) - 1, int(0.99 * len(times)))],
                "failed": failed,
            }
    return out


def run(tree: Path, streams: int, calls: int) -> dict[str, dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER],
        cwd=tree,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    opener = None
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        if streams:
            opener = subprocess.Popen(
                [sys.executable, "-c", OPENER, str(port), str(streams)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert opener.stdout.readline().strip() == "open"  # type: ignore[union-attr]
        return time_calls(port, calls)
    finally:
        for p in (opener, server):
            if p is not None:
                p.kill()
                p.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="0,260,1000", help="idle streams held open, comma-separated")
    parser.add_argument("--calls", type=int, default=100, help="timed calls of each kind per scenario")
    parser.add_argument("--baseline", default="0e85252", help="the threaded revision to compare with")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "idle_streams.json")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.streams.split(",") if c]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        trees = {
            "ours": worktree_import_tree(None, work),
            "threaded": worktree_import_tree(args.baseline, work),
        }
        try:
            for n in counts:
                for name, tree in trees.items():  # side by side, alternating
                    result = run(tree, n, args.calls)
                    rows.append(
                        {
                            "server": name,
                            "streams": n,
                            **{f"{k}_{m}": v for k, r in result.items() for m, v in r.items()},
                        }
                    )
                    print(
                        f"{name:>9} {n:>6} idle streams | join p50 {result['join']['p50_ms']:8.1f} ms  p99 {result['join']['p99_ms']:8.1f} ms"
                        f"  failed {result['join']['failed']:3d} | health p50 {result['health']['p50_ms']:8.1f} ms"
                        f"  p99 {result['health']['p99_ms']:8.1f} ms  failed {result['health']['failed']:3d}",
                        flush=True,
                    )
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "checkout")],
                capture_output=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"calls": args.calls, "deadline_s": DEADLINE_S, "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
