"""Durable coordinator state: atomic checkpoints, checksums, fallback, SQLite history."""

from __future__ import annotations

import logging
import sqlite3
from collections import OrderedDict

import pytest
import torch

from fedgrid.server.state import CorruptCheckpointError, StateStore


def _save(store, r):
    strategy = {
        "global_state": OrderedDict(w=torch.full((3,), float(r))),
        "momentum": torch.tensor([r * 0.5]),
    }
    history = [{"round": i, "loss": 1.0 / i} for i in range(1, r + 1)]
    return store.save(
        server_round=r, strategy=strategy, fleet={"run_id": "abc", "clients": []}, history=history
    )


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


def test_checkpoint_is_private_holds_no_token_and_keeps_value_types(tmp_path):
    from datetime import timedelta

    import numpy as np

    from fedgrid.server.remote_fleet import RemoteFleet
    from fedgrid.types import ClientInfo

    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    info, token = fleet.join(ClientInfo(client_id="", name="site-1", num_examples=4, codecs=("none", "int8")))
    strategy = {
        "global_state": OrderedDict(w=torch.arange(6.0).reshape(2, 3), steps=torch.tensor(7)),
        "server_optimizer": {"kind": "adam", "steps": 3, "buffers": {"m": {"w": torch.ones(2, 3)}}},
        "last_round": {"a": 2, 5: 1},  # a non-string key stays an int
        "pair": (1, 2.5),
        "odd": float("nan"),
        "np": np.float32(0.25),
        "raw": b"\x00\xff",
        "none": None,
        "view": torch.arange(4.0)[:2],  # a view of a larger storage
    }
    store = StateStore(tmp_path / "state")
    path = store.save(
        server_round=1, strategy=strategy, fleet=fleet.state_dict(), history=[{"round": 1, "loss": 0.5}]
    )
    fleet.close()
    assert path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700
    data = path.read_bytes()
    assert token.encode() not in data and b'token"' not in data
    ckpt = StateStore.read(path)
    got = ckpt.strategy
    assert isinstance(got["global_state"], OrderedDict) and list(got["global_state"]) == ["w", "steps"]
    assert (
        torch.equal(got["global_state"]["w"], strategy["global_state"]["w"])
        and got["global_state"]["steps"].dtype == torch.int64
    )
    assert torch.equal(got["server_optimizer"]["buffers"]["m"]["w"], torch.ones(2, 3))
    assert got["last_round"] == {"a": 2, 5: 1} and list(got["last_round"]) == ["a", 5]
    assert (
        got["pair"] == (1, 2.5)
        and got["odd"] != got["odd"]
        and got["np"] == np.float32(0.25)
        and type(got["np"]) is np.float32
    )
    assert (
        got["raw"] == b"\x00\xff"
        and got["none"] is None
        and torch.equal(got["view"], torch.tensor([0.0, 1.0]))
    )
    # A restored coordinator authenticates the session the client holds (by its hash).
    restored = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    restored.load_state_dict(ckpt.fleet)
    assert restored.authenticate(info.client_id, token).info == info
    with pytest.raises(Exception, match="bad session token"):
        restored.authenticate(info.client_id, token[:-1] + ("A" if token[-1] != "A" else "B"))
    restored.close()


def test_unstorable_value_is_refused_when_written(tmp_path):
    store = StateStore(tmp_path)
    with pytest.raises(TypeError, match="strategy.bad: object cannot be stored"):
        store.save(server_round=1, strategy={"bad": object()}, fleet={}, history=[])
    assert store.checkpoints() == []


def test_pickle_is_never_loaded(tmp_path, monkeypatch):
    import pickle

    import xxhash

    from fedgrid.server import state as state_module

    def forbidden(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    store = StateStore(tmp_path)
    _save(store, 1)
    newest = tmp_path / "ckpt-00000002.bin"
    payload = pickle.dumps(
        {"round": 2, "strategy": {}, "fleet": {}, "history": []}
    )  # well-formed, checksummed, a pickle
    newest.write_bytes(state_module.MAGIC + xxhash.xxh3_64_intdigest(payload).to_bytes(8, "little") + payload)
    with pytest.raises(CorruptCheckpointError, match="ckpt-00000002.bin: cannot decode"):
        StateStore.read(newest)
    assert store.load_latest().round == 1  # the corrupt newest falls back as before


def test_previous_format_is_refused_by_name(tmp_path):
    from fedgrid.server.state import CheckpointFormatError

    store = StateStore(tmp_path)
    _save(store, 1)
    old = tmp_path / "ckpt-00000002.bin"
    old.write_bytes(b"FGCKPT01" + bytes(8) + b"\x80\x04old pickle")
    with pytest.raises(
        CheckpointFormatError, match=r"ckpt-00000002.bin: checkpoint format FGCKPT01 \(torch.save pickle"
    ):
        store.load_latest()  # not skipped: resuming round 1 past it would silently lose round 2
