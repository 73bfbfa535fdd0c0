"""Unit tests of the client's saved state (``fedgrid.client.runtime``: ``state_path``)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Mapping

import pytest
import torch

from fedgrid import cli
from fedgrid.client import runtime
from fedgrid.client.api import Client, FitOutput
from fedgrid.client.runtime import Connection
from fedgrid.client.state import STATE_FORMAT, load_client_state, restore_client_state, save_client_state
from fedgrid.client.uplink import UplinkEncoder
from fedgrid.compression.spec import CodecSpec

RUN = "run-0123"


class Counting(Client):
    """A client with state of its own: how many tasks it trained."""

    def __init__(self, name: str = "counting") -> None:
        self.name = name
        self.fits = 0

    def fit(self, state, ins):
        self.fits += 1
        return FitOutput(OrderedDict(state), 1)

    def state_dict(self) -> dict[str, Any]:
        return {"fits": self.fits}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.fits = int(state["fits"])


def _encoder(codec: str = "topk:0.1", rounds: int = 2) -> UplinkEncoder:
    """An encoder that sent ``rounds`` updates, so its residuals are not zero."""
    g = torch.Generator().manual_seed(3)
    enc = UplinkEncoder(CodecSpec.parse(codec))
    base = OrderedDict(w=torch.zeros(8, 5), b=torch.zeros(5), steps=torch.tensor(2))
    for _ in range(rounds):
        new = OrderedDict(
            w=torch.randn(8, 5, generator=g), b=torch.randn(5, generator=g), steps=torch.tensor(3)
        )
        enc.encode(global_state=base, new_state=new)
    return enc


@pytest.fixture
def conn():
    c = Connection("127.0.0.1:1")  # never called: holds the encoders
    yield c
    c.close()


def test_saved_state_loads_back_with_equal_residuals(tmp_path, conn):
    enc = _encoder()
    conn.load_uplink_state_dict(
        {"topk:0.1": enc.state_dict(), "none": UplinkEncoder(CodecSpec.parse("none")).state_dict()}
    )
    client = Counting()
    client.fits = 7
    path = tmp_path / "deep" / "client-0.pt"
    save_client_state(path, run_id=RUN, server_round=4, client=client, conn=conn)
    assert [p.name for p in path.parent.iterdir()] == ["client-0.pt"]  # no temporary file left

    saved = load_client_state(path, name="counting")
    assert saved is not None
    assert (saved["format"], saved["run_id"], saved["round"], saved["client"]) == (
        STATE_FORMAT,
        RUN,
        4,
        {"fits": 7},
    )
    other = Connection("127.0.0.1:1")
    restored = Counting()
    other.run_id = RUN
    assert restore_client_state(other, restored, saved, path)
    assert restored.fits == 7
    residuals = other.uplink_state_dict()["topk:0.1"]["feedback"]["residuals"]
    assert set(residuals) == {"w", "b"}
    for name, tensor in enc.feedback.residuals.items():
        assert tensor.abs().sum() > 0
        torch.testing.assert_close(residuals[name], tensor, rtol=0, atol=0)
    assert set(other.uplink_state_dict()) == {"topk:0.1", "none"}
    other.close()


def test_state_of_another_run_is_not_restored(tmp_path, conn, caplog):
    conn.load_uplink_state_dict({"topk:0.1": _encoder().state_dict()})
    path = tmp_path / "client-0.pt"
    save_client_state(path, run_id="old-run", server_round=2, client=Counting(), conn=conn)
    saved = load_client_state(path, name="counting")
    fresh = Connection("127.0.0.1:1")
    fresh.run_id = "new-run"
    client = Counting()
    with caplog.at_level(logging.WARNING, logger="fedgrid.client"):
        assert not restore_client_state(fresh, client, saved, path)
    assert "is from run old-run, the coordinator runs new-run" in caplog.text
    assert fresh.uplink_state_dict() == {} and client.fits == 0
    fresh.close()


def test_state_that_does_not_fit_is_ignored_whole(tmp_path, conn, caplog):
    state = _encoder().state_dict()
    state["feedback"]["codec"] = "int8"  # residuals of another codec under this spec
    saved = {
        "format": STATE_FORMAT,
        "run_id": RUN,
        "round": 1,
        "name": "counting",
        "uplink": {"none": UplinkEncoder(CodecSpec.parse("none")).state_dict(), "topk:0.1": state},
        "client": {"fits": 3},
    }
    conn.run_id = RUN
    client = Counting()
    with caplog.at_level(logging.ERROR, logger="fedgrid.client"):
        assert not restore_client_state(conn, client, saved, tmp_path / "x.pt")
    assert "does not fit this client, ignoring it" in caplog.text
    assert conn.uplink_state_dict() == {} and client.fits == 0


@pytest.mark.parametrize(
    "content, message",
    [
        (b"not a torch file at all", "is unreadable, ignoring it"),
        ("truncated", "is unreadable, ignoring it"),
        ({"some": "dict"}, f"is not a {STATE_FORMAT} file"),
        ({"format": STATE_FORMAT, "run_id": 5, "uplink": {}}, "lacks its run id or uplink state"),
        (
            {
                "format": STATE_FORMAT,
                "run_id": RUN,
                "round": 1,
                "name": "someone-else",
                "uplink": {},
                "client": None,
            },
            "belongs to client 'someone-else', not 'counting'",
        ),
    ],
    ids=["garbage", "truncated", "foreign-dict", "no-run-id", "other-client"],
)
def test_corrupt_or_foreign_file_is_logged_and_ignored(tmp_path, conn, caplog, content, message):
    path = tmp_path / "client-0.pt"
    if content == "truncated":
        conn.load_uplink_state_dict({"topk:0.1": _encoder().state_dict()})
        save_client_state(path, run_id=RUN, server_round=1, client=Counting(), conn=conn)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with caplog.at_level(logging.ERROR, logger="fedgrid.client"):
        assert load_client_state(path, name="counting") is None
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and str(path) in errors[0].getMessage() and message in errors[0].getMessage()


def test_missing_file_is_a_fresh_start(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="fedgrid.client"):
        assert load_client_state(tmp_path / "none.pt", name="counting") is None
    assert caplog.records == []


def test_failed_save_leaves_the_previous_file(tmp_path, conn, monkeypatch):
    path = tmp_path / "client-0.pt"
    conn.load_uplink_state_dict({"topk:0.1": _encoder().state_dict()})
    save_client_state(path, run_id=RUN, server_round=1, client=Counting(), conn=conn)
    before = path.read_bytes()

    def full_disk(obj, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)  # what save_client_state writes with
    with pytest.raises(OSError, match="No space"):
        save_client_state(path, run_id=RUN, server_round=2, client=Counting(), conn=conn)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["client-0.pt"]


def test_cli_client_puts_the_state_in_state_dir(tmp_path, monkeypatch):
    calls = []

    def fake_run(client, *, coordinator, state_path=None, **options):
        calls.append((coordinator, state_path))
        return runtime.RunSummary(client_id="c", rounds=0)

    monkeypatch.setattr(runtime, "run_client", fake_run)
    assert (
        cli.main(
            [
                "client",
                "--coordinator",
                "127.0.0.1:9",
                "--partition",
                "2/5",
                "--state-dir",
                str(tmp_path / "s"),
            ]
        )
        == 0
    )
    assert cli.main(["client", "--coordinator", "127.0.0.1:9", "--partition", "1/5"]) == 0
    assert calls == [("127.0.0.1:9", tmp_path / "s" / "client-2.pt"), ("127.0.0.1:9", None)]


class StillTraining(Counting):
    """A client whose steps after the upload run on (overlapped DiLoCo) until ``done`` is set."""

    def __init__(self) -> None:
        super().__init__("still-training")
        self.done = threading.Event()
        self.lookahead_running = True

    def state_dict(self) -> dict[str, Any]:
        assert self.done.wait(timeout=30), "the state was asked for before the steps ended"
        self.lookahead_running = False
        return {"fits": self.fits}


def test_a_client_still_training_is_saved_once_it_ends_without_holding_the_runtime(tmp_path, conn):
    from fedgrid.types import FIT

    enc = _encoder()
    conn.load_uplink_state_dict({"topk:0.1": enc.state_dict()})
    client = StillTraining()
    client.fits = 3
    path = tmp_path / "client-0.pt"
    saver = runtime.StateSaver(path, conn, client)
    step = type("Step", (), {"kind": FIT, "round": 5})()
    saver.save(step)  # returns although state_dict blocks: the write waits in its own thread
    assert not path.exists()
    conn.load_uplink_state_dict({})  # the runtime moves on; the file keeps the residuals of the upload
    client.fits = 4  # the steps end with this state
    client.done.set()
    saver.wait()
    saved = load_client_state(path, name="still-training")
    assert saved is not None and saved["round"] == 5 and saved["client"] == {"fits": 4}
    kept, sent = (
        saved["uplink"]["topk:0.1"]["feedback"]["residuals"],
        enc.state_dict()["feedback"]["residuals"],
    )
    assert list(kept) == list(sent) and all(torch.equal(kept[n], sent[n]) for n in sent)


def test_a_client_not_training_is_saved_before_save_returns(tmp_path, conn):
    from fedgrid.types import FIT

    client = Counting()
    client.fits = 2
    path = tmp_path / "client-0.pt"
    runtime.StateSaver(path, conn, client).save(type("Step", (), {"kind": FIT, "round": 1})())
    saved = load_client_state(path, name="counting")
    assert saved is not None and saved["client"] == {"fits": 2}
