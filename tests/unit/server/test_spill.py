"""The spill off the reply's path: without a state directory, updates under the memory
budget are held, and written back in the background (oldest first) only when the budget
needs their room; under one, every update is in place before
its reply (a killed process finds it) and fsynced in the background, before the round closes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import timedelta

import pytest
import torch

from fedgrid.clock import ManualClock
from fedgrid.server import spill as spill_mod
from fedgrid.server.spill import HeldState, SpilledState, SpillWriter, UpdateSpill
from fedgrid.types import ClientInfo, TensorSpec

from clocked import Call, asleep

TASK = "run-r1-fit"


def _update(seed: int) -> "OrderedDict[str, torch.Tensor]":
    g = torch.Generator().manual_seed(seed)
    return OrderedDict([("w", torch.randn(64, 32, generator=g)), ("b", torch.randn(32, generator=g))])


NBYTES = (64 * 32 + 32) * 4


def _accept(spill: UpdateSpill, client_id: str, update):
    writer = spill.writer(
        task_id=TASK,
        client=ClientInfo(client_id=client_id),
        specs=TensorSpec.of(update),
        num_examples=5,
        metrics={"loss": 0.5},
    )
    assert writer is not None
    for name, tensor in update.items():
        writer.write(name, tensor)
    return writer, writer.commit()


@pytest.fixture
def gate(monkeypatch):
    """Background writes wait at ``sync`` until the test opens the gate (and the test's small
    updates are written back like large ones)."""
    monkeypatch.setattr(spill_mod, "WRITE_BACK_BYTES", 0)
    opened = threading.Event()
    original = SpillWriter.sync

    def gated(self):
        assert opened.wait(30), "the test never opened the gate"
        original(self)

    monkeypatch.setattr(spill_mod.SpillWriter, "sync", gated)
    return opened


def _assert_equal(state, update):
    assert list(state) == list(update)
    for name, tensor in update.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
    for (name, tensor), expected in zip(state.items(), update.values()):
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0)


def _flush_times_out(spill: UpdateSpill, clock: ManualClock) -> None:
    """``spill.flush`` of timeout 30 s returns ``False`` once 30 s of ``clock`` passed, and not before."""
    flush = Call(lambda: spill.flush(timeout=timedelta(seconds=30)))
    asleep(clock)
    clock.advance(29.5)
    assert not flush.done()
    clock.advance(0.5)
    assert flush.result() is False


def test_held_updates_stay_in_memory_until_the_budget_needs_their_room(gate):
    clock = ManualClock()
    spill = UpdateSpill(
        None, memory_bytes=2 * NBYTES, clock=clock
    )  # no state directory: nothing to resume from
    first, second = _update(0), _update(1)
    _, state1 = _accept(spill, "c1", first)
    _, state2 = _accept(spill, "c2", second)
    path1, path2 = spill.dir / TASK / "c1.safetensors", spill.dir / TASK / "c2.safetensors"
    assert isinstance(state1, HeldState) and not state1.on_disk and not state2.on_disk
    assert spill.flush(timeout=timedelta(0))  # nothing was queued: a round closes at once
    assert not path1.exists() and not path2.exists() and spill.held_bytes == 2 * NBYTES
    _assert_equal(state1, first)  # readable while held
    third = spill.writer(
        task_id=TASK,
        client=ClientInfo(client_id="c3"),
        specs=TensorSpec.of(first),
        num_examples=1,
        metrics={},
    )
    assert isinstance(
        third, SpillWriter
    )  # over the budget: this one goes to its file, and the oldest makes room
    _flush_times_out(spill, clock)  # c1's write waits at the gate
    assert spill.held_bytes == 2 * NBYTES  # reserved until its file lands
    gate.set()
    assert spill.flush(timeout=timedelta(seconds=30))
    assert state1.on_disk and path1.exists() and spill.held_bytes == NBYTES
    assert not state2.on_disk and not path2.exists()  # only as much as the next update needs
    _assert_equal(state1, first)  # now read from the file
    _assert_equal(state2, second)
    third.abort()
    fourth = spill.writer(
        task_id=TASK,
        client=ClientInfo(client_id="c4"),
        specs=TensorSpec.of(first),
        num_examples=1,
        metrics={},
    )
    assert not isinstance(fourth, SpillWriter)  # room again: held
    fourth.abort()
    spill.clear()
    assert spill.held_bytes == 0
    spill.close()


def test_under_a_state_directory_an_update_is_in_place_before_its_reply_and_synced_after(
    tmp_path, monkeypatch
):
    synced = threading.Event()
    fsyncs: list[int] = []
    real_fsync = spill_mod.os.fsync

    def gated_fsync(fd):
        assert synced.wait(30), "the test never let the fsync run"
        fsyncs.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(spill_mod.os, "fsync", gated_fsync)
    clock = ManualClock()
    spill = UpdateSpill(
        tmp_path, memory_bytes=10 * NBYTES, clock=clock
    )  # the budget does not apply under a state directory
    update = _update(0)
    writer, state = _accept(
        spill, "c1", update
    )  # returns with its fsync still held back: off the reply's path
    assert isinstance(writer, SpillWriter) and isinstance(state, SpilledState) and spill.held_bytes == 0
    # A coordinator killed now (a new spill on the same directory) restores it: the client is not asked again.
    restored = UpdateSpill(tmp_path).restore(task_id=TASK, assigned={"c1": ClientInfo(client_id="c1")})
    assert (
        list(restored) == ["c1"]
        and restored["c1"].num_examples == 5
        and restored["c1"].metrics == {"loss": 0.5}
    )
    _assert_equal(restored["c1"].state, update)
    _flush_times_out(spill, clock)  # the round cannot close before the fsync
    synced.set()
    assert spill.flush(timeout=timedelta(seconds=30))
    assert len(fsyncs) == 2  # the file, then its folder (the rename)
    spill.close()


def test_update_over_the_budget_is_on_disk_before_commit_returns(gate):
    gate.set()  # the direct path writes on the caller's thread
    spill = UpdateSpill(None, memory_bytes=NBYTES - 1)
    update = _update(1)
    writer, state = _accept(spill, "c1", update)
    assert isinstance(writer, SpillWriter) and isinstance(state, SpilledState)
    assert (spill.dir / TASK / "c1.safetensors").exists() and spill.held_bytes == 0
    _assert_equal(state, update)
    spill.close()


def test_budget_counts_uploads_in_flight_and_aborts_give_it_back(gate):
    gate.set()
    spill = UpdateSpill(None, memory_bytes=NBYTES)
    specs = TensorSpec.of(_update(0))
    first = spill.writer(
        task_id=TASK, client=ClientInfo(client_id="a"), specs=specs, num_examples=1, metrics={}
    )
    second = spill.writer(
        task_id=TASK, client=ClientInfo(client_id="b"), specs=specs, num_examples=1, metrics={}
    )
    assert not isinstance(first, SpillWriter) and isinstance(second, SpillWriter)  # the budget holds one
    assert spill.held_bytes == NBYTES
    first.abort()
    first.abort()  # idempotent
    second.abort()
    assert spill.held_bytes == 0
    assert not list((spill.dir / TASK).iterdir())  # nothing left behind
    spill.close()


def test_no_budget_writes_every_update_before_its_reply():
    spill = UpdateSpill(None, memory_bytes=0)
    writer, state = _accept(spill, "c1", _update(2))
    assert isinstance(writer, SpillWriter) and (spill.dir / TASK / "c1.safetensors").exists()
    spill.close()


def test_discarded_held_update_never_lands(gate):
    spill = UpdateSpill(None, memory_bytes=2 * NBYTES)
    _accept(spill, "late", _update(3))
    _, kept = _accept(spill, "kept", _update(4))
    third = spill.writer(
        task_id=TASK,
        client=ClientInfo(client_id="c3"),
        specs=TensorSpec.of(_update(5)),
        num_examples=1,
        metrics={},
    )
    assert isinstance(third, SpillWriter)  # "late" is queued for its write-back, held at the gate
    spill.discard(task_id=TASK, client_id="late")  # the round closed before this upload completed
    gate.set()
    assert spill.flush(timeout=timedelta(seconds=30))
    third.abort()
    assert not list((spill.dir / TASK).iterdir())  # the discarded one never landed
    assert not kept.on_disk and spill.held_bytes == NBYTES  # the other is still held
    spill.close()


def test_negative_budget_is_refused(tmp_path):
    with pytest.raises(ValueError, match="memory_bytes"):
        UpdateSpill(tmp_path, memory_bytes=-1)


def test_small_held_updates_stay_in_memory_until_their_round_is_cleared(monkeypatch):
    monkeypatch.setattr(spill_mod, "WRITE_BACK_BYTES", NBYTES + 1)  # the test's updates count as small
    spill = UpdateSpill(None, memory_bytes=2 * NBYTES)
    update = _update(6)
    _, state = _accept(spill, "c1", update)
    assert spill.flush(timeout=timedelta(seconds=5))  # nothing to write
    assert (
        isinstance(state, HeldState)
        and not state.on_disk
        and not (spill.dir / TASK / "c1.safetensors").exists()
    )
    _assert_equal(state, update)
    assert spill.held_bytes == NBYTES  # still reserved: the budget bounds what is kept
    _accept(spill, "c2", _update(7))
    third = spill.writer(
        task_id=TASK,
        client=ClientInfo(client_id="c3"),
        specs=TensorSpec.of(update),
        num_examples=1,
        metrics={},
    )
    assert isinstance(third, SpillWriter)  # the budget is spent: this one goes to its file
    third.abort()
    spill.discard(task_id=TASK, client_id="c2")
    assert spill.held_bytes == NBYTES
    spill.clear()
    assert spill.held_bytes == 0
    spill.close()
