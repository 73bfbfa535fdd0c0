"""Capabilities over gRPC: what clients report at Join decides which of them a configured
coordinator gives tasks to, and which block BCD's ``capacity`` schedule gives each.

The coordinator is a real ``fedgrid coordinator`` process (``apps/event_coordinator.py``: its
events read as they happen); the clients are real gRPC clients, a ``fedgrid client`` process
stating its capabilities with flags and SDK clients stating theirs with
``Client.capability_override``, all training ``apps/linear_app.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fedgrid.capabilities import CapabilityOverride
from fedgrid.client import ClientHandle, TorchClient
from fedgrid.client import start_client as start  # harness.start_client starts a process

from harness import CoordinatorRun, start_client, wait_until

sys.path.insert(0, str(Path(__file__).parents[1] / "support" / "apps"))
import linear_app  # noqa: E402

GiB = 1 << 30


def _sdk_client(index: int, name: str, override: CapabilityOverride) -> TorchClient:
    client = linear_app.client(index, 4, seed=1)
    client.name, client.capability_override = name, override
    return client


def _finish(run: CoordinatorRun, handles: list[ClientHandle], log: Path, procs=()) -> None:
    try:
        assert run.proc.wait(timeout=180) == 0, log.read_text()[-3000:]
        for proc in procs:
            assert proc.wait(timeout=60) == 0
        for handle in handles:
            handle.join(timeout=60)
    finally:
        for proc in [run.proc, *procs]:
            if proc.poll() is None:
                proc.kill()
        for handle in handles:
            handle.stop()


def _uploads_by_round(run: CoordinatorRun) -> dict[int, set[str]]:
    """The names of the clients whose fit update each round accepted."""
    names = {e["client"]: e["name"] for e in run.seen("client_joined")}
    out: dict[int, set[str]] = {}
    for e in run.seen("update_accepted", evaluate=False):
        out.setdefault(e["round"], set()).add(names[e["client"]])
    return out


def test_a_coordinator_configured_with_requirements_selects_only_qualifying_clients(tmp_path):
    config = tmp_path / "coordinator.toml"
    config.write_text('require_device = "cuda"\nmin_client_memory = "8GiB"\nmin_accelerators = 1\n')
    log = tmp_path / "coordinator.log"
    run = CoordinatorRun(
        tmp_path / "run",
        [
            "--config",
            str(config),
            "--model",
            "linear_app:model",
            "--rounds",
            "2",
            "--min-clients",
            "2",
            "--seed",
            "1",
        ],
        log,
    )
    address = run.address()
    # The clients that fall short join first: a coordinator that ignored the requirements
    # would have four clients to ask, and round 1 would ask them all.
    short = [
        start(
            _sdk_client(0, "cpu-host", CapabilityOverride(memory_bytes=512 * GiB)), address, poll_wait_s=1.0
        ),  # device cpu
        start(
            _sdk_client(1, "small-gpu", CapabilityOverride("cuda", 1, 4 * GiB)), address, poll_wait_s=1.0
        ),  # memory
        start(
            _sdk_client(2, "no-gpu-count", CapabilityOverride("cuda", 0, 80 * GiB)), address, poll_wait_s=1.0
        ),  # accelerators
    ]
    wait_until(lambda: len(run.seen("client_joined")) == 3, timeout=60, what="the short clients to join")
    assert run.seen("round_opened") == []  # three live clients, none qualifying: no round
    good = start(_sdk_client(3, "big-gpu", CapabilityOverride("cuda", 2, 80 * GiB)), address, poll_wait_s=1.0)
    cli = start_client(
        address,
        tmp_path / "cli-client.log",
        "--app",
        "linear_app:client",
        "--partition",
        "0/2",
        "--seed",
        "1",
        "--report-device",
        "cuda",
        "--report-accelerators",
        "1",
        "--report-memory",
        "16GiB",
    )
    _finish(run, [*short, good], log, [cli])
    assert _uploads_by_round(run) == {1: {"big-gpu", "linear-0/2"}, 2: {"big-gpu", "linear-0/2"}}
    assert [e["clients"] for e in run.seen("round_opened", evaluate=False)] == [2, 2]
    assert [h.summary.rounds for h in short] == [0, 0, 0] and good.summary.rounds == 2
    text = log.read_text()
    assert "client 'cpu-host' takes no tasks: device 'cpu' is not 'cuda'" in text
    assert f"client 'small-gpu' takes no tasks: memory {4 * GiB} bytes, less than {8 * GiB}" in text


class Recording(TorchClient):
    """A linear-app client that records the block each BCD task gives it."""

    blocks: list[tuple[int, int]]

    def fit(self, state, ins):
        self.blocks.append((ins.round, int(ins.config["block"])))
        return super().fit(state, ins)


def test_bcd_capacity_gives_the_largest_block_to_the_client_reporting_the_most_memory(tmp_path):
    log = tmp_path / "coordinator.log"
    # Blocks: weight (3 elements, block 0) and bias (1 element, block 1).
    run = CoordinatorRun(
        tmp_path / "run",
        [
            "--model",
            "linear_app:model",
            "--strategy",
            "bcd",
            "--block-schedule",
            "capacity",
            "--block-prefixes",
            "weight;bias",
            "--rounds",
            "2",
            "--min-clients",
            "3",
            "--seed",
            "1",
        ],
        log,
    )
    address = run.address()
    # Canonical (name) order differs from memory order, so a schedule that ignored memory
    # (cyclic, or capacity over equal reports) would deal the blocks otherwise.
    memory = {"a": 32 * GiB, "b": 2 * GiB, "c": 8 * GiB}
    clients = []
    for i, (name, nbytes) in enumerate(memory.items()):
        client = _sdk_client(i, name, CapabilityOverride(memory_bytes=nbytes))
        client.__class__ = Recording
        client.blocks = []
        clients.append(client)
    handles = [start(c, address, poll_wait_s=1.0) for c in clients]
    _finish(run, handles, log)
    # k = 3 clients >= B = 2 blocks: memory ranks b < c < a get block-size ranks 0, 0, 1.
    assert {c.name: c.blocks for c in clients} == {
        "a": [(1, 0), (2, 0)],
        "b": [(1, 1), (2, 1)],
        "c": [(1, 1), (2, 1)],
    }
    assert [h.summary.rounds for h in handles] == [2, 2, 2]
