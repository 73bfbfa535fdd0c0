"""An upload cut mid-stream resumes from the chunk the coordinator acknowledged."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from fedgrid.client.runtime import Connection
from fedgrid.proto import serde

from harness import InProcessCoordinator, Relay, wait_until
from harness_clients import Named


def test_cut_upload_resumes_from_acknowledged_chunk():
    g = torch.Generator().manual_seed(2)
    state = OrderedDict(
        [("a", torch.randn(3_000_000, generator=g)), ("b", torch.randn(1_000_000, generator=g))]
    )  # 16 MB, 16 chunks
    server = InProcessCoordinator(state)
    relay = Relay(server.coordinator.port)
    try:
        conn = Connection(relay.address, retry_max_wait=0.2)
        conn.join(Named("resumer"))
        server.open_round()
        task = conn.poll(5).task
        update = OrderedDict((k, v * 2) for k, v in conn.download(task.task_id).items())
        before = relay.upstream_bytes
        result: list[int] = []
        uploader = threading.Thread(
            target=lambda: result.append(conn.upload(task.task_id, task.round, update, 3, {"loss": 1.0}))
        )
        uploader.start()
        # Cut once half is sent and the coordinator is checking the stream (under load it may
        # not have begun yet, and then it holds nothing to resume from).
        wait_until(
            lambda: (
                relay.upstream_bytes - before > 7_000_000
                and conn.client_id in server.fleet.current_round.uploading
            ),
            timeout=60,
            what="half the upload, being checked",
            interval=0.001,
        )
        relay.cut()
        uploader.join(timeout=60)
        assert result == [16_000_000]

        first, second = conn.upload_attempts
        # Resumed from the chunks the coordinator had verified when the connection broke (some
        # of what the first try sent was still in flight), not restarted.
        assert first.start_chunk == 0 and second.start_chunk >= 1
        encoded = serde.EncodedModel(update)
        info = serde.StreamInfo(
            run_id=conn.run_id,
            task_id=task.task_id,
            round=task.round,
            client_id=conn.client_id,
            num_examples=3,
            metrics={"loss": 1.0},
            resume_from_chunk=0,
        )
        rest = sum(len(f) for f in encoded.frames(info, chunk_size=conn.chunk_size, start=second.start_chunk))
        full = sum(len(f) for f in encoded.frames(info, chunk_size=conn.chunk_size))
        assert second.bytes_sent == rest
        assert (
            rest <= full - second.start_chunk * conn.chunk_size + 1024
        )  # only the missing chunks, plus a header
        outcome = server.wait_round()
        assert len(outcome.results) == 1 and outcome.results[0].num_examples == 3
        for name, tensor in update.items():
            assert torch.equal(outcome.results[0].state[name], tensor)
        conn.close()
    finally:
        relay.close()
        server.stop()


def test_upload_over_a_link_too_slow_for_a_chunk_falls_back_to_smaller_chunks(caplog):
    """At 4 Mbit/s a 1 MiB chunk takes 2.1 s, over the coordinator's 1 s idle limit: every try
    would time out at the same chunk. The client halves its chunks after a try in which none
    got through, and the upload lands whole."""
    from fedgrid.ops.wan import WanLink, WanRelay

    g = torch.Generator().manual_seed(3)
    state = OrderedDict([("w", torch.randn(300_000, generator=g))])  # 1.2 MB: two 1 MiB chunks
    server = InProcessCoordinator(state, stream_idle_s=1.0)
    with WanRelay(server.address, WanLink(rate_mbit=4)) as relay:
        try:
            conn = Connection(relay.address, retry_max_wait=0.5)
            conn.join(Named("slow-link"))
            assert conn.chunk_size == serde.CHUNK_SIZE == conn.upload_chunk_cap
            server.open_round(timeout_s=150)
            task = conn.poll(5).task
            update = OrderedDict((k, v * 2) for k, v in conn.download(task.task_id).items())
            with caplog.at_level("WARNING", logger="fedgrid.client.connection"):
                assert conn.upload(task.task_id, task.round, update, 3, {"loss": 1.0}) == 1_200_000
            sizes = [a.chunk_size for a in conn.upload_attempts]
            assert sizes[0] == serde.CHUNK_SIZE and len(sizes) >= 2
            assert all(b in (a, a // 2) for a, b in zip(sizes, sizes[1:]))  # halved, or kept for a resume
            # The chunks that landed take well under the 1 s limit at 0.5 MB/s.
            assert 16 << 10 <= conn.upload_chunk_cap == sizes[-1] <= 256 << 10
            assert "no chunk reached the coordinator in time" in caplog.text
            outcome = server.wait_round(timeout=150)
            assert len(outcome.results) == 1 and not outcome.failures
            assert torch.equal(outcome.results[0].state["w"], update["w"])
            conn.close()
        finally:
            server.stop()
