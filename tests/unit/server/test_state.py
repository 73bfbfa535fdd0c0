"""Durable coordinator state: atomic checkpoints, checksums, fallback, SQLite history."""

from __future__ import annotations

import logging
import sqlite3
from collections import OrderedDict

import pytest
import torch

from fedgrid.server.state import CorruptCheckpointError, StateStore


def _save(store, r):
    strategy = {"global_state": OrderedDict(w=torch.full((3,), float(r))), "momentum": torch.tensor([r * 0.5])}
    history = [{"round": i, "loss": 1.0 / i} for i in range(1, r + 1)]
    return store.save(server_round=r, strategy=strategy, fleet={"run_id": "abc", "clients": []}, history=history)


def test_round_trip_and_keep(tmp_path):
    store = StateStore(tmp_path, keep=2)
    for r in range(1, 5):
        _save(store, r)
    assert [r for r, _ in store.checkpoints()] == [4, 3]  # older ones pruned
    ckpt = store.load_latest()
    assert ckpt.round == 4
    assert torch.equal(ckpt.strategy["global_state"]["w"], torch.full((3,), 4.0))
    assert ckpt.fleet["run_id"] == "abc" and [h["round"] for h in ckpt.history] == [1, 2, 3, 4]
    assert [h["round"] for h in store.history()] == [1, 2, 3, 4]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_corrupt_newest_falls_back_to_previous(tmp_path, caplog, damage):
    store = StateStore(tmp_path)
    _save(store, 1)
    newest = _save(store, 2)
    data = bytearray(newest.read_bytes())
    if damage == "flip":
        data[-10] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[:8] = b"NOTFEDGR"
    newest.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=newest.name):
        StateStore.read(newest)
    with caplog.at_level(logging.ERROR, logger="fedgrid.server.state"):
        ckpt = store.load_latest()
    assert ckpt.round == 1 and torch.equal(ckpt.strategy["global_state"]["w"], torch.ones(3))
    assert any("corrupt checkpoint" in r.message and newest.name in r.message for r in caplog.records)


def test_history_is_reconciled_to_the_checkpoint(tmp_path):
    store = StateStore(tmp_path)
    _save(store, 3)
    with sqlite3.connect(tmp_path / "history.sqlite") as db:  # a row from a round never committed
        db.execute("INSERT INTO rounds (round, metrics, committed_at) VALUES (4, '{}', 0)")
    store.sync_history([{"round": 1}, {"round": 2}, {"round": 3}])
    store.sync_history([{"round": 1}, {"round": 2}, {"round": 3}])  # idempotent
    assert [h["round"] for h in store.history()] == [1, 2, 3]


def test_no_checkpoint(tmp_path):
    assert StateStore(tmp_path).load_latest() is None
    with pytest.raises(ValueError, match="keep"):
        StateStore(tmp_path, keep=1)
