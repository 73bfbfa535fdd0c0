"""A region SIGKILLed at each point of a global task where it holds state, and restarted from its
state directory, ends on the uninterrupted run's model, bit for bit, each round run once.

The region keeps two kinds of state across a kill: its regional rounds (checkpoints in its
state directory) and its WAN uplink's error-feedback residual (``upstream.pt``); its clients
keep their LAN uplink's residuals in memory. Both links are lossy here (bf16 on the LAN, int8
on the WAN, error feedback on both), so a regional round run twice, an update encoded twice or
a residual that lags the upload it belongs to each change the model.

Kills (``apps/event_region.py``; each restart carries the next one), with H = 2:

1. after regional round 1 is committed: the restarted region must go on with round 2, not run
   round 1 again (its clients' residuals already hold round 1's update);
2. once a client's update of regional round 4 was accepted, before the round commits: the
   update that landed is restored, not asked for again;
3. after the global coordinator accepted global round 3's upload, before the state file
   (``upstream.pt``) is written: the next upload must start from round 3's residual;
4. after global round 4's upload was encoded and its state written, before it is sent: the
   task is handed to the restarted region, which must send the same bytes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from fedgrid.events import read_events
from fedgrid.runlog import read_metrics

import zygote
from harness import THREADS, Relay, assert_same_model, child_env, start_client, start_coordinator, wait_until

ROUNDS, H, CLIENTS, SEED = 4, 2, 2, 7
KILLS = [(1, "round_committed"), (4, "update_accepted"), (3, "upstream_uploaded"), (4, "upstream_saved")]
APP = Path(__file__).parents[1] / "support" / "apps" / "event_region.py"


def _region(tmp_path: Path, upstream: str, trigger: tuple[int, str] | None) -> subprocess.Popen:
    fault = [] if trigger is None else [str(trigger[0]), trigger[1]]
    out = tmp_path / "region"
    (out / "address").unlink(missing_ok=True)
    flags = [
        *("--upstream", upstream, "--name", "region-a", "--listen", "127.0.0.1:0"),
        *("--out", str(out), "--state-dir", str(tmp_path / "region-state")),
        *("--threads", str(THREADS), "--seed", str(SEED), "--min-clients", str(CLIENTS)),
        *("--regional-rounds", str(H), "--codec", "bf16", "--round-timeout-s", "120"),
    ]
    proc = zygote.popen(
        [sys.executable, str(APP), *fault, "--", *flags],
        stdout=open(tmp_path / "region.log", "a"),
        stderr=subprocess.STDOUT,
        env=child_env(),
    )
    wait_until(
        lambda: (
            (out / "address").exists()
            and (out / "address").read_text().strip() != ""
            or proc.poll() is not None
        ),
        timeout=60,
        what="the region's address",
    )
    assert proc.poll() is None, (tmp_path / "region.log").read_text()[-3000:]
    return proc


def _run(tmp_path: Path, kills: list[tuple[int, str]]) -> list[subprocess.Popen]:
    """The global coordinator, region-a (killed at each of ``kills`` in turn and restarted on a
    new port behind a relay, so its clients' address stays) and its clients, to the end."""
    tmp_path.mkdir()
    coordinator, address = start_coordinator(
        tmp_path / "global",
        *("--rounds", str(ROUNDS), "--min-clients", "1", "--seed", str(SEED), "--codec", "int8"),
        # A region restarted within three heartbeats keeps its open task (handed to its new session).
        *("--heartbeat-interval-s", "10", "--round-timeout-s", "120"),
    )
    triggers: list[tuple[int, str] | None] = [*kills, None]
    regions = [_region(tmp_path, address, triggers[0])]
    relay = Relay(None)

    def port() -> int:
        return int((tmp_path / "region" / "address").read_text().strip().rpartition(":")[2])

    relay.retarget(port())
    clients = [
        start_client(
            relay.address, tmp_path / f"client{i}.log", "--partition", f"{i}/{CLIENTS}", "--seed", str(SEED)
        )
        for i in range(CLIENTS)
    ]
    try:
        for trigger in triggers[1:]:
            killed = regions[-1]
            assert killed.wait(timeout=180) == -signal.SIGKILL, (tmp_path / "region.log").read_text()[-3000:]
            relay.retarget(None)
            regions.append(_region(tmp_path, address, trigger))
            relay.retarget(port())
        for proc in [regions[-1], coordinator, *clients]:
            assert proc.wait(timeout=180) == 0, [
                p.read_text()[-3000:] for p in sorted(tmp_path.glob("*.log"))
            ]
    finally:
        for proc in [*regions, coordinator, *clients]:
            if proc.poll() is None:
                proc.kill()
        relay.close()
    return regions


def _committed(events: Path) -> Counter:
    return Counter(e["round"] for e in read_events(events) if e.event == "round_committed")


def test_a_region_killed_at_each_point_of_a_task_ends_on_the_uninterrupted_model(tmp_path):
    _run(tmp_path / "reference", [])
    regions = _run(tmp_path / "killed", KILLS)

    assert len(regions) == len(KILLS) + 1
    log = (tmp_path / "killed" / "region.log").read_text()
    fired = [
        line.split(" at ", 1)[1] for line in log.splitlines() if line.startswith("event_region: SIGKILL")
    ]
    assert fired == ["round_committed of round 1", "update_accepted of round 4"] + [
        "upstream_uploaded of round 3",
        "upstream_saved of round 4",
    ]
    for run in ("reference", "killed"):
        top, region = tmp_path / run / "global", tmp_path / run / "region"
        # Each round committed once, across every restart: none run again.
        assert _committed(top / "events.jsonl") == Counter(range(1, ROUNDS + 1)), run
        assert _committed(region / "events.jsonl") == Counter(range(1, ROUNDS * H + 1)), run
        assert [m["round"] for m in read_metrics(top)] == list(range(1, ROUNDS + 1))
        assert [m["round"] for m in read_metrics(region)] == list(range(1, ROUNDS * H + 1))
    # The kill after a client's update landed restored it: not asked for, not encoded, twice.
    restored = [
        e
        for e in read_events(tmp_path / "killed" / "region" / "events.jsonl")
        if e.event == "updates_restored"
    ]
    assert [(e["round"], e["count"]) for e in restored] == [(4, 1)]
    # Each restart but the one after round 3's upload landed took its open global task over.
    handed = {
        e["round"]
        for e in read_events(tmp_path / "killed" / "global" / "events.jsonl")
        if e.event == "task_handed_over"
    }
    assert handed >= {1, 2, 4}, handed
    assert_same_model(tmp_path / "killed" / "global", tmp_path / "reference" / "global")
