"""Default values for every deadline, size and interval, in one place.

Each can be overridden from the environment with the ``FEDGRID_*`` name given beside it.
"""

from __future__ import annotations

import os

__all__ = [
    "CHUNK_SIZE",
    "MAX_MESSAGE_BYTES",
    "MAX_TENSOR_BYTES",
    "MAX_REPORTED_S",
    "RPC_TIMEOUT_S",
    "TRANSFER_TIMEOUT_S",
    "POLL_WAIT_S",
    "HEARTBEAT_INTERVAL_S",
    "RETRY_MAX_WAIT_S",
    "RETRY_MAX_ELAPSED_S",
    "FINISH_GRACE_S",
    "MAX_REASON_CHARS",
    "STREAM_IDLE_S",
    "MAX_POLLS_PER_CLIENT",
    "MAX_TRANSFERS",
    "MAX_TRANSFERS_PER_CLIENT",
    "MAX_TRANSFERS_PER_CONNECTION",
    "HEADER_TIMEOUT_S",
    "MAX_SESSIONS",
    "LOG_BURST_LINES",
    "LOG_SUMMARY_S",
    "MAX_STREAMS_PER_CONNECTION",
    "KEEPALIVE_TIME_S",
    "KEEPALIVE_TIMEOUT_S",
    "MIN_CLIENT_PING_INTERVAL_S",
    "MAX_CONNECTION_IDLE_S",
    "MAX_PHASE_MESSAGE_BYTES",
    "MAX_OUTBOX_BYTES",
    "MAX_INBOX_REPLY_BYTES",
    "SPILL_MEMORY_BYTES",
    "BUFFER_POOL_BYTES",
    "BUFFER_POOL_IDLE_S",
    "GIL_SWITCH_INTERVAL_S",
    "ENROLL_MAX_MESSAGE_BYTES",
    "ENROLL_MAX_CONCURRENT",
    "ENROLL_TIMEOUT_S",
    "MAX_NUM_EXAMPLES",
    "CONNECT_TIMEOUT_S",
    "WAITING_REPORT_S",
    "HEALTH_TIMEOUT_S",
    "LAUNCH_START_TIMEOUT_S",
    "LAUNCH_STOP_GRACE_S",
    "HTTP_REQUEST_TIMEOUT_S",
    "HTTP_MAX_CONNECTIONS",
    "HTTP_MAX_CONNECTIONS_PER_PEER",
    "ROUND_RETRIES",
]


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from exc


#: Payload bytes per data chunk (FEDGRID_CHUNK_SIZE).
CHUNK_SIZE = int(_env_float("FEDGRID_CHUNK_SIZE", 1 << 20))
#: Largest gRPC message either side accepts: a chunk plus framing, far under gRPC's 4 MB default.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: Largest single tensor payload a receiver allocates (FEDGRID_MAX_TENSOR_BYTES).
MAX_TENSOR_BYTES = int(_env_float("FEDGRID_MAX_TENSOR_BYTES", 16 * (1 << 30)))
#: Deadline of a unary RPC (FEDGRID_RPC_TIMEOUT_S).
RPC_TIMEOUT_S = _env_float("FEDGRID_RPC_TIMEOUT_S", 30.0)
#: Deadline of a model download or upload stream (FEDGRID_TRANSFER_TIMEOUT_S).
TRANSFER_TIMEOUT_S = _env_float("FEDGRID_TRANSFER_TIMEOUT_S", 600.0)
#: Longest time the coordinator holds a long poll (FEDGRID_POLL_WAIT_S).
POLL_WAIT_S = _env_float("FEDGRID_POLL_WAIT_S", 10.0)
#: Client heartbeat interval (FEDGRID_HEARTBEAT_INTERVAL_S).
HEARTBEAT_INTERVAL_S = _env_float("FEDGRID_HEARTBEAT_INTERVAL_S", 5.0)
#: Cap of the exponential backoff between retries (FEDGRID_RETRY_MAX_WAIT_S).
RETRY_MAX_WAIT_S = _env_float("FEDGRID_RETRY_MAX_WAIT_S", 10.0)
#: Give up retrying a transient failure after this long (FEDGRID_RETRY_MAX_ELAPSED_S).
RETRY_MAX_ELAPSED_S = _env_float("FEDGRID_RETRY_MAX_ELAPSED_S", 120.0)
#: A client that has not reached its coordinator once (its first Join) within this long gives
#: up: a wrong address or port, a coordinator not running, a TLS mismatch (FEDGRID_CONNECT_TIMEOUT_S).
CONNECT_TIMEOUT_S = _env_float("FEDGRID_CONNECT_TIMEOUT_S", 60.0)
#: A coordinator waiting for min_clients says so this often, and whenever a client joins
#: (FEDGRID_WAITING_REPORT_S).
WAITING_REPORT_S = _env_float("FEDGRID_WAITING_REPORT_S", 10.0)
#: After the last round, how long the coordinator waits for clients to hear that the run ended.
FINISH_GRACE_S = _env_float("FEDGRID_FINISH_GRACE_S", 15.0)
#: Longest failure or leave reason a client sends (characters); the coordinator refuses longer.
MAX_REASON_CHARS = 1000
#: An upload stream that sends nothing for this long is given up (what arrived is kept for resume).
STREAM_IDLE_S = _env_float("FEDGRID_STREAM_IDLE_S", 60.0)
#: Long polls one client may hold at once; more are refused (RESOURCE_EXHAUSTED).
MAX_POLLS_PER_CLIENT = int(_env_float("FEDGRID_MAX_POLLS_PER_CLIENT", 2))
#: Model downloads and uploads in flight on the coordinator at once; more are refused.
MAX_TRANSFERS = int(_env_float("FEDGRID_MAX_TRANSFERS", 1024))
#: Transfers one client (its certificate's identity; without TLS, its session) may have in
#: flight at once (FEDGRID_MAX_TRANSFERS_PER_CLIENT). The SDK runs one at a time; a retry can
#: overlap a stream still winding down. Counted from the moment its session is checked.
MAX_TRANSFERS_PER_CLIENT = int(_env_float("FEDGRID_MAX_TRANSFERS_PER_CLIENT", 4))
#: Transfers one connection (``context.peer()``: address and port) may have in flight at once
#: (FEDGRID_MAX_TRANSFERS_PER_CONNECTION): a process multiplexing many sessions on one
#: connection holds at most this share of ``MAX_TRANSFERS``.
MAX_TRANSFERS_PER_CONNECTION = int(_env_float("FEDGRID_MAX_TRANSFERS_PER_CONNECTION", 64))
#: An upload stream must send its header (its first message: the header and the first chunk)
#: within this long of being opened, or it ends with DEADLINE_EXCEEDED
#: (FEDGRID_HEADER_TIMEOUT_S; never more than ``STREAM_IDLE_S``). The SDK sends it at once (the
#: update is encoded before the call); a link too slow to carry a 1 MiB chunk in 10 s (under
#: 0.9 Mbit/s) makes the SDK retry with smaller chunks, as a stalled upload does.
HEADER_TIMEOUT_S = _env_float("FEDGRID_HEADER_TIMEOUT_S", 10.0)
#: Sessions the coordinator's membership holds at once (FEDGRID_MAX_SESSIONS): a Join past it,
#: once silent sessions are purged, is refused (RESOURCE_EXHAUSTED; clients retry). Five times
#: the 10,000 clients the coordinator is sized for; under mutual TLS an identity holds one.
MAX_SESSIONS = int(_env_float("FEDGRID_MAX_SESSIONS", 50_000))
#: Lines one kind of per-client log record (joins, silent clients dropped, refused calls) may
#: take per ``LOG_SUMMARY_S`` (FEDGRID_LOG_BURST_LINES); past that one summary line counts the rest.
LOG_BURST_LINES = int(_env_float("FEDGRID_LOG_BURST_LINES", 20))
LOG_SUMMARY_S = _env_float("FEDGRID_LOG_SUMMARY_S", 10.0)
#: The most often a client logs its progress inside a task (``fedgrid.client.progress``).
PROGRESS_LOG_S = _env_float("FEDGRID_PROGRESS_LOG_S", 10.0)
#: Concurrent streams on one HTTP/2 connection (gRPC's ``grpc.max_concurrent_streams``).
MAX_STREAMS_PER_CONNECTION = int(_env_float("FEDGRID_MAX_STREAMS_PER_CONNECTION", 256))
#: The coordinator pings a connection idle this long, and drops it when no answer comes
#: within ``KEEPALIVE_TIMEOUT_S`` (half-open connections of vanished clients).
#: Measured: with 10 s, loaded client processes (2,000 protocol clients sharing 2 cores with
#: the coordinator) missed acks and lost whole connections; a client busy training misses them too.
KEEPALIVE_TIME_S = _env_float("FEDGRID_KEEPALIVE_TIME_S", 60.0)
KEEPALIVE_TIMEOUT_S = _env_float("FEDGRID_KEEPALIVE_TIMEOUT_S", 30.0)
#: Clients may ping at most this often; faster pingers are disconnected.
MIN_CLIENT_PING_INTERVAL_S = _env_float("FEDGRID_MIN_CLIENT_PING_INTERVAL_S", 10.0)
#: A connection with no call for this long is closed (the client reconnects when it needs to).
MAX_CONNECTION_IDLE_S = _env_float("FEDGRID_MAX_CONNECTION_IDLE_S", 300.0)
#: Largest payload of one message in a message phase (FEDGRID_MAX_PHASE_MESSAGE_BYTES).
MAX_PHASE_MESSAGE_BYTES = int(_env_float("FEDGRID_MAX_PHASE_MESSAGE_BYTES", 64 * 1024))
#: Largest sum of payloads one client sends in one message phase (FEDGRID_MAX_OUTBOX_BYTES);
#: it bounds the coordinator's memory per phase to this times the clients of the phase.
MAX_OUTBOX_BYTES = int(_env_float("FEDGRID_MAX_OUTBOX_BYTES", 1 << 20))
#: Payload bytes of relayed messages in one ReceiveMessages reply; a larger inbox is paged.
MAX_INBOX_REPLY_BYTES = 2 * 1024 * 1024
#: Accepted updates a coordinator without a state directory holds in memory
#: (FEDGRID_SPILL_MEMORY_BYTES): written back to disk, oldest first and in the background,
#: only when the budget needs their room; an update that does not fit is written before the
#: client hears it was accepted. 0: every update is on disk before its reply. See ``server/spill.py``.
SPILL_MEMORY_BYTES = int(_env_float("FEDGRID_SPILL_MEMORY_BYTES", 1 << 30))
#: Free receive buffers a process keeps for the next transfer (FEDGRID_BUFFER_POOL_BYTES).
#: Freshly mapped memory faults in at about 0.9 GB/s on a VM, reused memory takes copies at
#: over 10 GB/s, so reusing the last transfer's buffers is most of a receiver's speed. 512 MiB
#: holds one 100M-parameter float32 model (400 MB) with room: the next download or upload of
#: such a model reuses all of it; a larger model reuses what fits. It costs at most this much
#: memory beyond what is in use, and only for ``BUFFER_POOL_IDLE_S``. 0: no pool. See ``proto/buffers.py``.
BUFFER_POOL_BYTES = int(_env_float("FEDGRID_BUFFER_POOL_BYTES", 512 << 20))
#: A free receive buffer unused this long goes back to the system (FEDGRID_BUFFER_POOL_IDLE_S).
#: Reuse saves about 1 s per GB received; after a gap of 30 s that is under a few percent of
#: the gap, so keeping buffers longer buys little, and an idle process gives them back soon.
BUFFER_POOL_IDLE_S = _env_float("FEDGRID_BUFFER_POOL_IDLE_S", 30.0)
#: The coordinator process's GIL switch interval (FEDGRID_GIL_SWITCH_INTERVAL_S; Python's
#: default is 5 ms). Its event loop and the executor threads checking uploads hand the GIL
#: back and forth for every frame; at 5 ms a thread that gave it up (numpy's copy, xxhash)
#: often waits a whole interval to get it back: 1,224 against 1,514 MB/s of 100 MB uploads
#: at 0.2 ms, 1,408 against 1,591 at 1 ms (``benchmarks/transport.py``, 2 cores).
GIL_SWITCH_INTERVAL_S = _env_float("FEDGRID_GIL_SWITCH_INTERVAL_S", 0.001)
#: Largest message the enrollment service accepts: a CSR is under 1 KiB (EC) or 2 KiB (RSA-4096),
#: so 16 KiB refuses junk before it is parsed, for peers that hold no certificate yet.
ENROLL_MAX_MESSAGE_BYTES = 16 * 1024
#: Enrollments signed at once (FEDGRID_ENROLL_MAX_CONCURRENT); more are refused (RESOURCE_EXHAUSTED).
#: Each holds a thread and waits on the certificate directory's lock, which serializes them anyway.
ENROLL_MAX_CONCURRENT = int(_env_float("FEDGRID_ENROLL_MAX_CONCURRENT", 4))
#: Deadline of an enrollment, on both sides (FEDGRID_ENROLL_TIMEOUT_S): signing takes milliseconds.
ENROLL_TIMEOUT_S = _env_float("FEDGRID_ENROLL_TIMEOUT_S", 10.0)
#: Largest ``num_examples`` a client may report at Join or claim for an update
#: (FEDGRID_MAX_NUM_EXAMPLES; the ``max_num_examples`` config key overrides it per run). An
#: update's weight is its claim: without a cap one client claiming 2**64-1 examples *is* the
#: weighted mean. A billion examples is more than any one federated client holds.
MAX_NUM_EXAMPLES = int(_env_float("FEDGRID_MAX_NUM_EXAMPLES", 10**9))
#: The most seconds a fit result may report in a field of its time split (``compute_s``,
#: ``wall_s``, ...: ``fedgrid.telemetry.SPLIT_KEYS``): about 31 years, more than any window or
#: any region's sum over its workers' windows, and far enough from float's range that sums of
#: them stay finite in ``metrics.jsonl`` and in ``/metrics``' histograms.
MAX_REPORTED_S = _env_float("FEDGRID_MAX_REPORTED_S", 1e9)
#: Deadline of one ``fedgrid health`` check, connection included (FEDGRID_HEALTH_TIMEOUT_S):
#: under a container's health-check timeout, so a hung peer reads as unhealthy, not as a killed probe.
HEALTH_TIMEOUT_S = _env_float("FEDGRID_HEALTH_TIMEOUT_S", 5.0)
#: ``fedgrid launch``: longest wait for a coordinator or region to write its address
#: (FEDGRID_LAUNCH_START_TIMEOUT_S); importing torch on a loaded 2-core machine takes seconds.
LAUNCH_START_TIMEOUT_S = _env_float("FEDGRID_LAUNCH_START_TIMEOUT_S", 120.0)
#: ``fedgrid launch``: how long its processes get to stop after SIGTERM before they are
#: killed (FEDGRID_LAUNCH_STOP_GRACE_S): a coordinator's own stop grace (5 s) and a client's
#: leave RPC fit in it.
LAUNCH_STOP_GRACE_S = _env_float("FEDGRID_LAUNCH_STOP_GRACE_S", 20.0)
#: The HTTP status server (``--http``, ``fedgrid.webserve``): a connection has this long from
#: its accept to send its whole request (headers and body) and take its answer, then it is
#: closed (FEDGRID_HTTP_REQUEST_TIMEOUT_S). A slowloris peer sending a byte now and then holds
#: its connection this long at most, however it paces the bytes.
HTTP_REQUEST_TIMEOUT_S = _env_float("FEDGRID_HTTP_REQUEST_TIMEOUT_S", 5.0)
#: Connections the HTTP status server holds at once (FEDGRID_HTTP_MAX_CONNECTIONS); more are
#: answered 503 and closed. An open asyncio connection costs a few KiB and no thread.
HTTP_MAX_CONNECTIONS = int(_env_float("FEDGRID_HTTP_MAX_CONNECTIONS", 256))
#: Connections one peer (an IPv4 address, or an IPv6 /64) holds at once on the HTTP status
#: server (FEDGRID_HTTP_MAX_CONNECTIONS_PER_PEER); more are answered 503, so one host that
#: holds its share blocks only itself.
HTTP_MAX_CONNECTIONS_PER_PEER = int(_env_float("FEDGRID_HTTP_MAX_CONNECTIONS_PER_PEER", 8))
#: A coordinator's round whose results are all lost (its clients or regions died, left or went
#: silent) runs again under the same number, at most this many times in a row; then the run stops
#: with its state committed (FEDGRID_ROUND_RETRIES).
ROUND_RETRIES = int(_env_float("FEDGRID_ROUND_RETRIES", 5))
