"""Recovery refuses rather than guesses, and a full disk is one clear error (issue 26, items 4-5)."""

from __future__ import annotations

import errno
import sqlite3
from collections import OrderedDict

import pytest
import torch
import xxhash

from fedgrid.errors import RecoveryError, StorageError
from fedgrid.server import state as state_module
from fedgrid.server.state import CorruptCheckpointError, StateStore
from fedgrid.server.state_codec import content_of, payload_of

from full_disk import full_disk


def _save(store: StateStore, r: int):
    strategy = {"global_state": OrderedDict(w=torch.full((3,), float(r)))}
    history = [{"round": i, "loss": 1.0 / i} for i in range(1, r + 1)]
    return store.save(
        server_round=r, strategy=strategy, fleet={"run_id": "abc", "clients": []}, history=history
    )


def _rewrite(path, change) -> None:
    """Rewrites checkpoint ``path`` with ``change(content)`` and a recomputed checksum: damage
    that the checksum cannot see."""
    data = path.read_bytes()
    content = dict(content_of(data[16:]))
    change(content)
    payload = payload_of(content)
    path.write_bytes(state_module.MAGIC + xxhash.xxh3_64_intdigest(payload).to_bytes(8, "little") + payload)


def test_all_checkpoints_unreadable_refuses_to_start_and_names_them(tmp_path):
    store = StateStore(tmp_path)
    paths = [_save(store, r) for r in (1, 2, 3)]
    for path in paths:
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(RecoveryError) as info:
        store.load_latest()
    message = str(info.value)
    assert "no checkpoint is readable" in message and "--fresh" in message
    assert all(f"{p.name}: checksum mismatch" in message for p in paths)
    assert [r for r, _ in store.checkpoints()] == [3, 2, 1]  # nothing removed


def test_a_journal_with_no_checkpoint_left_refuses_to_start(tmp_path):
    store = StateStore(tmp_path)
    for r in (1, 2):
        _save(store, r).unlink()
    with pytest.raises(
        RecoveryError, match=r"records 2 committed rounds \(up to round 2\) but no checkpoint"
    ):
        store.load_latest()


def test_a_checkpoint_whose_round_is_not_its_name_is_refused(tmp_path):
    store = StateStore(tmp_path)
    _save(store, 4)
    planted = tmp_path / "ckpt-00000009.bin"
    (tmp_path / "ckpt-00000004.bin").rename(planted)
    with pytest.raises(
        CorruptCheckpointError, match="ckpt-00000009.bin: holds round 4, its name says round 9"
    ):
        StateStore.read(planted)
    with pytest.raises(RecoveryError, match="ckpt-00000009.bin: holds round 4, its name says round 9"):
        store.load_latest()  # the only checkpoint: refused, not resumed as round 9


def test_a_checkpoint_whose_round_is_rewritten_with_its_checksum_is_refused(tmp_path):
    store = StateStore(tmp_path)
    _save(store, 3)
    newest = _save(store, 4)
    _rewrite(newest, lambda c: c.update(round=9))
    with pytest.raises(CorruptCheckpointError, match="holds round 9, its name says round 4"):
        StateStore.read(newest)
    renamed = tmp_path / "ckpt-00000009.bin"
    newest.rename(renamed)  # and named to match: its own history still ends at round 4
    with pytest.raises(CorruptCheckpointError, match="holds round 9, but the history inside ends at round 4"):
        StateStore.read(renamed)


def test_a_checkpoint_the_journal_does_not_know_is_refused(tmp_path):
    store = StateStore(tmp_path)
    _save(store, 2)
    # A checkpoint of round 6 from elsewhere, consistent in itself: the journal ends at round 2.
    other = StateStore(tmp_path / "other")
    planted = _save(other, 6)
    planted.rename(tmp_path / planted.name)
    with pytest.raises(
        RecoveryError, match="ckpt-00000006.bin .round 6.: history.sqlite records rounds up to 2 only"
    ):
        store.load_latest()


def test_a_journal_that_records_another_version_of_the_round_is_refused(tmp_path):
    store = StateStore(tmp_path)
    _save(store, 1)
    _rewrite(
        _save(store, 2), lambda c: c.update(history=[{"round": 1, "loss": 1.0}, {"round": 2, "loss": 0.25}])
    )
    with pytest.raises(RecoveryError, match="history.sqlite records another round 2 than the checkpoint's"):
        store.load_latest()


def test_a_journal_one_round_behind_its_checkpoint_resumes(tmp_path):
    store = StateStore(tmp_path)
    _save(store, 1)
    _save(store, 2)
    with sqlite3.connect(tmp_path / "history.sqlite") as db:  # killed between the rename and the journal
        db.execute("DELETE FROM rounds WHERE round = 2")
    assert store.load_latest().round == 2


def test_fresh_sets_the_old_run_aside(tmp_path):
    store = StateStore(tmp_path)
    for r in (1, 2):
        _save(store, r).write_bytes(b"garbage")
    (tmp_path / "updates").mkdir()
    with pytest.raises(RecoveryError):
        store.load_latest()
    aside = store.set_aside()
    assert aside is not None and aside.parent == tmp_path and aside.name.startswith("discarded-")
    assert sorted(p.name for p in aside.iterdir() if not p.name.startswith("history.sqlite-")) == [
        "ckpt-00000001.bin",
        "ckpt-00000002.bin",
        "history.sqlite",
        "updates",
    ]
    assert store.load_latest() is None and store.history() == []
    _save(store, 1)  # a new run
    assert store.load_latest().round == 1
    assert StateStore(tmp_path / "empty").set_aside() is None


def test_an_authenticated_checkpoint_needs_its_key(tmp_path):
    key = bytes(range(32))
    store = StateStore(tmp_path, key=key)
    path = _save(store, 1)
    assert path.read_bytes()[:8] == b"FGCKPT2H"
    assert store.load_latest().round == 1
    with pytest.raises(CorruptCheckpointError, match="an authenticated checkpoint: give its --state-key"):
        StateStore.read(path)
    with pytest.raises(CorruptCheckpointError, match="authentication failed"):
        StateStore.read(path, key=bytes(32))
    # One planted by a process that can write the state directory, but not read the key:
    plain = _save(StateStore(tmp_path / "plain"), 2)
    plain.rename(tmp_path / plain.name)
    with pytest.raises(CorruptCheckpointError, match="not authenticated"):
        StateStore.read(tmp_path / plain.name, key=key)
    with pytest.raises(ValueError, match="at least 32 bytes"):
        StateStore(tmp_path, key=b"short")


def test_a_full_disk_during_a_checkpoint_is_one_error_and_keeps_the_last_good_one(tmp_path):
    store = StateStore(tmp_path)
    _save(store, 1)
    with full_disk(tmp_path), pytest.raises(StorageError) as info:
        _save(store, 2)
    message = str(info.value)
    assert "\n" not in message and message.startswith("storage error writing ")
    assert "ckpt-00000002.tmp" in message and os_strerror_enospc() in message and "MiB free of" in message
    assert not list(tmp_path.glob("*.tmp")) and [r for r, _ in store.checkpoints()] == [1]
    assert store.load_latest().round == 1  # after space is freed


def test_a_full_disk_under_the_journal_is_a_storage_error_not_sqlite(tmp_path, monkeypatch):
    store = StateStore(tmp_path)

    def full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(sqlite3, "connect", full)
    with pytest.raises(
        StorageError, match=r"storage error writing .*history.sqlite: database or disk is full"
    ):
        store.sync_history([{"round": 1}])


def os_strerror_enospc() -> str:
    import os

    return os.strerror(errno.ENOSPC)


def test_fresh_and_state_key_are_config_keys_with_clear_errors(tmp_path):
    from fedgrid.config import load_config
    from fedgrid.errors import ConfigError
    from fedgrid.server.wiring import open_store

    for key, value in (("fresh", True), ("state_key", str(tmp_path / "key"))):
        with pytest.raises(ConfigError, match=f"config key '{key}': goes with state_dir"):
            load_config(overrides={key: value})
    (tmp_path / "short").write_bytes(b"x" * 8)
    with pytest.raises(
        ConfigError, match=r"config key 'state_key': the state key .*short holds 8 bytes, at least 32"
    ):
        open_store(
            load_config(overrides={"state_dir": str(tmp_path / "s"), "state_key": str(tmp_path / "short")})
        )
    with pytest.raises(ConfigError, match="cannot read the state key"):
        open_store(
            load_config(overrides={"state_dir": str(tmp_path / "s"), "state_key": str(tmp_path / "none")})
        )
    (tmp_path / "key").write_bytes(bytes(range(32)))
    state = tmp_path / "state"
    _save(open_store(load_config(overrides={"state_dir": str(state), "state_key": str(tmp_path / "key")})), 1)
    store = open_store(load_config(overrides={"state_dir": str(state)}))  # the key forgotten: refused
    with pytest.raises(RecoveryError, match="an authenticated checkpoint: give its --state-key"):
        store.load_latest()
    fresh = open_store(load_config(overrides={"state_dir": str(state), "fresh": True}))
    assert fresh.load_latest() is None and len(list(state.glob("discarded-*/ckpt-*.bin"))) == 1
