"""A TCP transfer between two lab hosts (``fedgrid.ops.lab``): ``python -m fedgrid.ops.lab_transfer``,
run inside them (``fedgrid.ops.lab.transfer_s`` does both ends).

``sink [TIMEOUT_S]``: listens on port 0 of every address, prints ``PORT``, takes one connection,
reads until the sender closes, replies ``ok`` and prints the bytes read; it gives up (exit 1)
when no connection comes, or the connection stalls, for ``TIMEOUT_S`` (default 60).
``send HOST:PORT BYTES [TIMEOUT_S]``: connects, sends ``BYTES``, closes its side and waits for
the reply; prints the seconds from the connect's start to the reply (the transfer's wall time).
A connect or transfer that fails or outlives ``TIMEOUT_S`` (default 60) prints its error and exits 1.
"""

from __future__ import annotations

import socket
import sys
import time

__all__ = ["sink", "send"]


def sink(timeout: float) -> int:
    server = socket.create_server(("0.0.0.0", 0))
    server.settimeout(timeout)
    print(server.getsockname()[1], flush=True)
    received = 0
    try:
        conn, _ = server.accept()
        conn.settimeout(timeout)
        while data := conn.recv(1 << 16):
            received += len(data)
        conn.sendall(b"ok")
        conn.close()
    except OSError as exc:
        print(f"{type(exc).__name__}: {exc} after {received} bytes", flush=True)
        return 1
    print(received, flush=True)
    return 0


def send(target: str, size: int, timeout: float) -> int:
    host, _, port = target.rpartition(":")
    started = time.monotonic()
    try:
        conn = socket.create_connection((host, int(port)), timeout=timeout)
        chunk = b"\0" * (1 << 16)
        left = size
        while left > 0:
            left -= conn.send(chunk[: min(left, len(chunk))])
        conn.shutdown(socket.SHUT_WR)
        reply = conn.recv(2)
    except OSError as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)
        return 1
    if reply != b"ok":
        print(f"no reply: {reply!r}", flush=True)
        return 1
    print(f"{time.monotonic() - started:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "sink":
        sys.exit(sink(float(sys.argv[2]) if len(sys.argv) > 2 else 60.0))
    else:
        sys.exit(send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]) if len(sys.argv) > 4 else 60.0))
