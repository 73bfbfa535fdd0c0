"""A resumable upload of one update (``Connection.upload``'s tries): each retry asks the
coordinator how many chunks it holds and sends the rest, and a try that got not one more chunk
through before its deadline makes the connection send smaller chunks from then on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import grpc

from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import serde

if TYPE_CHECKING:
    from fedgrid.client.connection import Connection

__all__ = ["UploadAttempt", "ResumableUpload", "MIN_UPLOAD_CHUNK"]

# The connection's logger: these records have always come from it.
log = logging.getLogger("fedgrid.client.connection")

#: The smallest upload chunk a slow link makes the client fall back to (``upload_chunk_cap``).
MIN_UPLOAD_CHUNK = 16 << 10


@dataclass(frozen=True)
class UploadAttempt:
    """One try at an upload: the chunk it started from, the bytes it sent (``sent[0]``) and
    the payload bytes per chunk it sent them in."""

    start_chunk: int
    sent: list[int]
    chunk_size: int = 0

    @property
    def bytes_sent(self) -> int:
        return self.sent[0]


class ResumableUpload:
    """The tries of one upload of ``encoded`` (described by ``info``) over ``conn``: calling it
    makes one try and returns the bytes the coordinator received; ``Connection._call`` retries
    it. The tries are recorded in ``conn.upload_attempts`` (reset here)."""

    def __init__(
        self, conn: Connection, task_id: str, encoded: serde.EncodedModel, info: serde.StreamInfo
    ) -> None:
        self.conn, self.task_id, self.encoded, self.info = conn, task_id, encoded, info
        self.status_request = pb.UploadStatusRequest(client_id=conn.client_id, task_id=task_id)
        self.stalled = False  # the last try ran out of time (DEADLINE_EXCEEDED)
        self.chunk_size = min(conn.chunk_size, conn.upload_chunk_cap)
        conn.upload_attempts = []

    def __call__(self) -> int:
        conn = self.conn
        start = 0
        if conn.upload_attempts:  # a retry: continue from what the coordinator holds
            status = conn.stub.UploadStatus(
                self.status_request, metadata=conn._session(), timeout=conn.rpc_timeout
            )
            if status.accepted:
                return self.encoded.total_bytes  # an earlier attempt landed; its reply was lost
            start = int(status.chunks_received)
            if (
                self.stalled
                and start <= conn.upload_attempts[-1].start_chunk
                and self.chunk_size > MIN_UPLOAD_CHUNK
            ):
                # Not one more chunk got through before the deadline: chunks this size take
                # longer than the coordinator waits for one. Start over in smaller ones (a
                # resume must keep the size of the chunks it continues).
                self.chunk_size, start = self._halve_chunks(), 0
        sent = [0]
        conn.upload_attempts.append(UploadAttempt(start, sent, self.chunk_size))
        self.stalled = False

        frames = self._counted(self.encoded.frames(self.info, chunk_size=self.chunk_size, start=start), sent)
        try:
            # Small frames several a message (``serde.batched``): one hop between threads, not one each.
            messages = serde.batched(frames, self.chunk_size)
            reply = conn._upload(messages, metadata=conn._session(), timeout=conn.transfer_timeout)
        except grpc.RpcError as exc:
            if len(conn.upload_attempts) > 1 and exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                return self.encoded.total_bytes
            self.stalled = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            raise
        return int(reply.bytes_received)

    def _halve_chunks(self) -> int:
        """The upload chunk size after a try in which no chunk reached the coordinator in time
        (half, down to ``MIN_UPLOAD_CHUNK``); the connection keeps it (``upload_chunk_cap``)."""
        conn = self.conn
        conn.upload_chunk_cap = max(MIN_UPLOAD_CHUNK, self.chunk_size // 2)
        log.warning(
            "upload of task %r: no chunk reached the coordinator in time; sending %d-byte chunks from now on",
            self.task_id,
            conn.upload_chunk_cap,
        )
        return conn.upload_chunk_cap

    def _counted(self, frames: Iterator[bytes], sent: list[int]) -> Iterator[bytes]:
        """``frames`` as they go, counted in ``sent[0]`` (this try's bytes) and ``bytes_up``."""
        for frame in frames:
            sent[0] += len(frame)
            self.conn.bytes_up += serde.wire_size(frame)
            yield frame
