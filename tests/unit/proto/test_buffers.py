"""Unit tests of ``fedgrid.proto.buffers``: reuse only of unreferenced memory, the caps, and
the assembler on pooled buffers (no old bytes exposed)."""

from __future__ import annotations

import gc
import io
import pickle
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from safetensors.torch import save, save_file

from fedgrid.compression.feedback import apply_delta
from fedgrid.compression.spec import CodecSpec
from fedgrid.errors import InvalidUpdateError
from fedgrid.proto import serde
from fedgrid.proto.buffers import MIN_POOLED_BYTES, BufferPool, receive_buffers
from fedgrid.server.spill import HeldState, SpilledState, SpillWriter
from fedgrid.types import TensorSpec

MiB = 1 << 20
N = 2 * MiB  # bytes of each test buffer: above MIN_POOLED_BYTES
FILL = 0xA5


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _pool(**kwargs: Any) -> BufferPool:
    kwargs.setdefault("max_free_bytes", 64 * MiB)
    kwargs.setdefault("idle_s", 3600.0)
    return BufferPool(**kwargs)


def _span(t: torch.Tensor | np.ndarray) -> tuple[int, int]:
    if isinstance(t, np.ndarray):
        start = t.__array_interface__["data"][0]
        return start, start + t.nbytes
    start = t.untyped_storage().data_ptr()
    return start, start + t.untyped_storage().nbytes()


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _state(nbytes: int = N, seed: int = 0) -> "OrderedDict[str, torch.Tensor]":
    gen = torch.Generator().manual_seed(seed)
    return OrderedDict(
        w=torch.randn(nbytes // 4, generator=gen), b=torch.randn(nbytes // 8, generator=gen).reshape(2, -1)
    )


def _decode(
    state: "OrderedDict[str, torch.Tensor]", pool: BufferPool, *, codec: str = "none"
) -> "OrderedDict[str, torch.Tensor]":
    asm = serde.ModelAssembler(buffers=pool)
    for frame in serde.EncodedModel(state, codec=CodecSpec.parse(codec)).frames(
        serde.StreamInfo(), chunk_size=256 * 1024
    ):
        asm.feed(frame)
    return asm.finish()[1]


# -- reuse and its safety --------------------------------------------------------------------------
def test_a_returned_buffer_is_reused() -> None:
    pool = _pool()
    first = pool.take(N)
    span = _span(first)
    del first
    second = pool.take(N)
    assert _span(second) == span
    assert (pool.stats().reused, pool.stats().allocated) == (1, 1)


def test_a_numpy_view_of_a_buffer_keeps_it() -> None:
    pool = _pool()
    view = pool.take(N)[N // 2 :].view(np.int32)
    span = _span(view)
    view[:] = 7
    taken = [pool.take(N) for _ in range(2)]
    for buf in taken:
        assert not _overlaps(_span(buf), span)
        buf[:] = FILL
    assert (view == 7).all()


def test_small_requests_and_a_zero_cap_are_plain_allocations() -> None:
    for pool, nbytes in ((_pool(), MIN_POOLED_BYTES - 1), (_pool(max_free_bytes=0), N)):
        a = pool.take(nbytes)
        assert a.nbytes == nbytes and a.flags.writeable
        del a
        s = pool.stats()
        assert (s.free_bytes, s.leased_buffers, s.allocated) == (0, 0, 0)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# Every way a received tensor is kept downstream, and how to read back what is kept; each
# must keep its buffer from being handed out again.
HOLDERS: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[Any], bytes]]] = {
    "tensor": (lambda t: t, _bytes),
    "slice": (lambda t: t[1:], _bytes),
    "dtype view + reshape": (lambda t: t.view(torch.int32).reshape(2, -1), _bytes),
    "detach": (lambda t: t.detach(), _bytes),
    "storage": (lambda t: t.untyped_storage(), lambda s: _bytes(torch.tensor([], dtype=torch.uint8).set_(s))),
    "numpy": (lambda t: t.numpy(), lambda a: a.tobytes()),
    "numpy slice": (lambda t: t.numpy()[3:], lambda a: a.tobytes()),
    "numpy dtype view": (lambda t: t.numpy().view(np.uint8).reshape(4, -1), lambda a: a.tobytes()),
    "memoryview": (lambda t: memoryview(t.numpy()), lambda m: m.tobytes()),
    "frombuffer": (lambda t: torch.frombuffer(memoryview(t.numpy()), dtype=torch.uint8), _bytes),
    "frombuffer of a view": (
        lambda t: torch.frombuffer(t.view(torch.uint8).numpy().data, dtype=torch.int16),
        _bytes,
    ),
    "HeldState": (
        lambda t: HeldState(Path("unused.safetensors"), OrderedDict(w=t)),
        lambda h: _bytes(h["w"]),
    ),
}


@pytest.mark.parametrize("how", list(HOLDERS))
def test_memory_held_downstream_is_never_handed_out_again(how: str) -> None:
    make, read = HOLDERS[how]
    pool = _pool()
    state = _state()
    received = _decode(state, pool)
    span = _span(received["w"])
    kept = make(received["w"])
    del received
    gc.collect()
    # Buffers of the held tensor's size, and of every other size the pool holds, overwritten.
    fresh = [pool.take(N), pool.take(N), pool.take(N // 2), pool.take(N // 2)]
    for buf in fresh:
        assert not _overlaps(_span(buf), span), f"{how}: a buffer still referenced was handed out again"
        buf[:] = FILL
    assert read(kept) == read(make(state["w"]))
    del fresh
    del kept
    gc.collect()
    assert _span(pool.take(N)) == span  # and once let go, it is reused


def test_a_buffer_comes_back_only_when_its_last_holder_goes() -> None:
    pool = _pool()
    received = _decode(_state(), pool)
    w_span = _span(received["w"])
    part = received["w"][10:20].view(torch.int32)
    del received
    gc.collect()
    assert pool.stats().free_bytes == N // 2  # "b" came back, "w" is still held through ``part``
    del part
    assert pool.stats().free_bytes == N + N // 2
    assert _span(pool.take(N)) == w_span


def test_copies_let_the_buffer_go(tmp_path: Path) -> None:
    """What copies the bytes (safetensors, pickling, apply_delta, clone, a decoding codec)
    keeps nothing of the buffer: it is free once the received tensors are dropped."""
    pool = _pool()
    state = _state()
    received = _decode(state, pool)
    save_file(dict(received), str(tmp_path / "a.safetensors"))
    blob = save(dict(received))
    pickled = pickle.dumps(received)
    summed = apply_delta(state, received)
    cloned = {k: v.clone() for k, v in received.items()}
    stream = io.BytesIO()
    torch.save(received, stream)
    writer = SpillWriter(
        tmp_path / "b.safetensors", {k: TensorSpec(v.dtype, tuple(v.shape)) for k, v in received.items()}, {}
    )
    for name in received:
        writer.write(name, received[name])
    on_disk: SpilledState = writer.commit()
    del received
    gc.collect()
    assert pool.stats().leased_buffers == 0
    for buf in (pool.take(N), pool.take(N // 2)):
        buf[:] = FILL
    for name, tensor in state.items():
        torch.testing.assert_close(on_disk[name], tensor, rtol=0, atol=0)
        torch.testing.assert_close(summed[name], 2 * tensor, rtol=0, atol=0)
        torch.testing.assert_close(cloned[name], tensor, rtol=0, atol=0)
        torch.testing.assert_close(pickle.loads(pickled)[name], tensor, rtol=0, atol=0)
    assert len(blob) > N


def test_a_decoding_codec_frees_its_buffer_at_once() -> None:
    pool = _pool()
    state = _state()
    received = _decode(state, pool, codec="none+zstd")
    assert pool.stats().leased_buffers == 0  # decoded into its own memory
    torch.testing.assert_close(received["w"], state["w"], rtol=0, atol=0)


# -- the assembler never exposes old bytes -----------------------------------------------------------
def test_a_truncated_stream_exposes_no_old_bytes() -> None:
    pool = _pool()
    stale = pool.take(N)
    stale[:] = FILL
    del stale  # free, holding FILL: the next tensor of this size gets it
    frames = list(
        serde.EncodedModel(_state(), codec=CodecSpec.NONE).frames(serde.StreamInfo(), chunk_size=256 * 1024)
    )
    asm = serde.ModelAssembler(buffers=pool)
    for frame in frames[:3]:  # part of "w" only
        asm.feed(frame)
    assert pool.stats().reused == 1
    with pytest.raises(InvalidUpdateError, match="truncated"):
        asm.finish()
    assert not asm.tensors
    # A stream cut short inside a tensor and followed by the next one fails the same way.
    asm = serde.ModelAssembler(buffers=pool)
    with pytest.raises(InvalidUpdateError, match="truncated"):
        for frame in frames[:3] + frames[8:]:
            asm.feed(frame)
        asm.finish()
    assert not asm.tensors


# -- bounds ---------------------------------------------------------------------------------------
def test_free_bytes_stay_under_the_cap_the_newest_kept() -> None:
    pool = _pool(max_free_bytes=3 * N)
    bufs = [pool.take(N) for _ in range(5)]
    spans = [_span(b) for b in bufs]
    for i in range(5):
        bufs[i] = None  # type: ignore[call-overload]
        assert pool.stats().free_bytes == min(i + 1, 3) * N
    taken = [pool.take(N) for _ in range(3)]
    assert {_span(b) for b in taken} == set(spans[2:])
    big = pool.take(4 * N)  # over the cap: dropped when it comes back
    del big
    assert pool.stats().free_bytes == 0


def test_idle_buffers_are_released() -> None:
    clock = Clock()
    pool = _pool(idle_s=30.0, clock=clock)
    a, b = pool.take(N), pool.take(2 * N)
    del a
    clock.now += 20
    del b
    clock.now += 15  # a idle 35 s, b 15 s
    pool.release_idle()  # (the background thread may have come first: the outcome is the same)
    assert pool.stats().free_bytes == 2 * N
    clock.now += 15
    pool.release_idle()
    assert pool.stats().free_buffers == 0


def test_the_background_thread_releases_idle_buffers() -> None:
    pool = _pool(idle_s=0.05)
    buf = pool.take(N)
    del buf
    assert pool.wait_idle(timedelta(seconds=10))
    assert pool.stats().free_bytes == 0


def test_constructor_checks_its_arguments() -> None:
    with pytest.raises(ValueError):
        BufferPool(max_free_bytes=-1)
    with pytest.raises(ValueError):
        BufferPool(idle_s=0)
    assert receive_buffers() is receive_buffers()
