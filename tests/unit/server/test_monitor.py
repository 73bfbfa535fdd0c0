"""``server/monitor.py``: the metrics and the status a coordinator's events and fleet add up to."""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from datetime import timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedgrid.clock import ManualClock
from fedgrid.server.monitor import FAILURE_REASONS, MAX_REGION_LABELS, CoordinatorMonitor, failure_reason
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.status_page import page_response
from fedgrid.types import ClientInfo, FitRes, RoundMetrics


def _samples(monitor: CoordinatorMonitor) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(monitor.metrics_text().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.mark.parametrize(
    "text, label",
    [
        ("missed the round deadline of 3.0s", "deadline"),
        ("client went silent (no heartbeat)", "silent"),
        ("silent for over 9.0s", "silent"),
        ("coordinator stopping", "stopping"),
        ("client reported: ValueError: \n[FAKE] injected", "client_error"),
        ("client left: KeyboardInterrupt", "left"),
        ("replaced by a new session of the same name", "replaced"),
        ("evaluated no examples", "no_examples"),
        ("\x1b[31manything a client makes up", "other"),
    ],
)
def test_failure_reasons_are_a_fixed_label_set(text, label):
    assert failure_reason(text) == label
    assert label in FAILURE_REASONS


def test_events_and_rounds_become_metrics_and_status():
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    history: list[RoundMetrics] = []
    monitor = CoordinatorMonitor(fleet, rounds=4, history=lambda: history)
    fleet.events.subscribe(monitor.on_event)
    a, _ = fleet.join(
        ClientInfo(
            "",
            name="alpha",
            region="eu",
            num_examples=5,
            device="cuda",
            num_accelerators=8,
            memory_bytes=80 << 30,
        )
    )
    b, _ = fleet.join(ClientInfo("", name="<b>beta</b>", region="us", num_examples=5, memory_bytes=16 << 30))
    ev = fleet.events
    ev.emit("started", run_id=fleet.run_id, address="x", threads=1)
    ev.emit("round_opened", round=1, task="t", clients=2, evaluate=False, phase="fit")
    status = monitor.status()
    assert (status["state"], status["phase"], status["round"], status["rounds"]) == ("running", "fit", 1, 4)
    assert [(c["name"], c["region"], c["state"]) for c in status["clients"]] == [
        ("<b>beta</b>", "us", "idle"),
        ("alpha", "eu", "idle"),
    ]
    assert [(c["device"], c["accelerators"], c["memory_bytes"]) for c in status["clients"]] == [
        ("cpu", 0, 16 << 30),
        ("cuda", 8, 80 << 30),
    ]
    ev.emit("round_closed", round=1, evaluate=False, phase="fit", reason="all", results=2, failures=0)
    ev.emit("aggregating", round=1, updates=2, failures=0)
    ev.emit("checkpoint_writing", round=1)
    ev.emit("checkpoint_written", round=1)
    ev.emit("round_committed", round=1)
    m = RoundMetrics(
        round=1,
        loss=0.5,
        accuracy=0.75,
        bytes_up=1000,
        bytes_down=2000,
        wall_s=1.5,
        clients_ok=2,
        clients_failed=0,
    )
    history.append(m)
    monitor.on_round(m)
    ev.emit("round_failed", round=2, reason="non-finite aggregate")
    ev.emit("client_left", client=a.client_id, reason="KeyboardInterrupt")
    ev.emit("client_dropped", client=b.client_id, reason="silent for over 3.0s")
    got = _samples(monitor)
    assert got[("fedgrid_rounds_committed_total", ())] == 1
    assert got[("fedgrid_rounds_failed_total", ())] == 1
    assert got[("fedgrid_clients_joined_total", ())] == 2
    assert got[("fedgrid_clients_gone_total", (("reason", "left"),))] == 1
    assert got[("fedgrid_clients_gone_total", (("reason", "dropped"),))] == 1
    assert got[("fedgrid_bytes_total", (("direction", "up"),))] == 1000
    assert got[("fedgrid_bytes_total", (("direction", "down"),))] == 2000
    assert got[("fedgrid_client_results_total", (("outcome", "ok"),))] == 2
    assert got[("fedgrid_live_clients", ())] == 2  # the membership still holds both (the events were made up)
    for phase in ("fit", "aggregate", "checkpoint"):
        assert got[("fedgrid_phase_duration_seconds_count", (("phase", phase),))] == 1
    assert got[("fedgrid_round_duration_seconds_sum", ())] == 1.5
    status = monitor.status()
    assert status["committed"] == 1 and status["phase"] == "waiting"
    assert status["history"] == [
        {
            "round": 1,
            "accuracy": 0.75,
            "loss": 0.5,
            "bytes_up": 1000,
            "bytes_down": 2000,
            "wall_s": 1.5,
            "clients_ok": 2,
            "clients_failed": 0,
            "failed": False,
        }
    ]
    # No client text in any label: the names and regions are nowhere in the metrics.
    text = monitor.metrics_text().decode()
    assert "beta" not in text and "alpha" not in text and '"eu"' not in text


def test_the_page_loads_nothing_from_elsewhere_and_names_its_nonce():
    first, second = page_response(), page_response()
    csp = first.headers["Content-Security-Policy"]
    nonce = re.search(r"script-src 'nonce-([^']+)'", csp).group(1)
    body = first.body.decode()
    assert f'<script nonce="{nonce}">' in body and f'<style nonce="{nonce}">' in body
    assert "default-src 'self'" in csp and "unsafe-inline" not in csp
    assert second.headers["Content-Security-Policy"] != csp  # a fresh nonce per response
    assert not re.search(r"\b(src|href)\s*=", body)  # no script, style, font or image from anywhere
    assert "innerHTML" not in body and "textContent" in body


def test_goodput_histograms_label_regions_boundedly_and_never_clients():
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    monitor = CoordinatorMonitor(fleet, rounds=1, history=lambda: [])
    split = {
        "wall_s": 4.0,
        "compute_s": 3.0,
        "comm_s": 0.5,
        "wait_s": 0.5,
        "transfer_s": 1.0,
        "utilization": 0.75,
    }
    results = [
        FitRes(ClientInfo(f"id-{i}", name=f"name-{i}", region=f"r{i}"), OrderedDict(), 1, split)
        for i in range(MAX_REGION_LABELS + 4)
    ]
    results.append(FitRes(ClientInfo("id-old", name="old", region="r0"), OrderedDict(), 1, {"loss": 1.0}))
    monitor.on_fit_results(results)
    got = _samples(monitor)
    counts = {
        dict(labels)["region"]: v
        for (name, labels), v in got.items()
        if name == "fedgrid_task_utilization_count"
    }
    assert len(counts) == MAX_REGION_LABELS + 1 and counts["other"] == 4 and counts["r0"] == 1
    assert got[("fedgrid_task_seconds_sum", (("part", "compute"), ("region", "r1")))] == 3.0
    text = monitor.metrics_text().decode()
    assert "name-" not in text and "id-" not in text
    assert [
        (r["region"], r["clients"]) for r in monitor.status()["regions"]
    ] == []  # none joined the membership


def test_a_clients_last_seen_is_read_on_the_fleets_clock():
    clock = ManualClock(start=1000.0)
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60), clock=clock)
    monitor = CoordinatorMonitor(fleet, rounds=1, history=lambda: [])
    info, token = fleet.join(ClientInfo("", name="site-1", num_examples=1))
    clock.advance(12.5)
    [row] = monitor.status()["clients"]
    assert row["last_seen_s"] == 12.5
    fleet.heartbeat(info.client_id, token)
    clock.advance(0.25)
    [row] = monitor.status()["clients"]
    assert row["last_seen_s"] == 0.25
    fleet.close()


def test_api_status_answers_strict_json_whatever_a_clients_figures():
    """A split that is not finite (the wire refuses one; a region's sum or an in-process fleet
    could still make one) is served as null, never as a 500."""
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    monitor = CoordinatorMonitor(fleet, rounds=1, history=lambda: [])
    info, _ = fleet.join(ClientInfo("", name="site-1", region="eu", num_examples=1))
    split = {"wall_s": 1.0, "compute_s": math.inf, "comm_s": 0.0, "wait_s": 0.0, "transfer_s": 0.0}
    monitor.on_fit_results([FitRes(info, OrderedDict(), 1, {**split, "utilization": math.nan})])
    response = monitor.routes()["/api/status"].handler()

    def refuse(constant: str) -> object:
        raise ValueError(f"not JSON: {constant}")

    status = json.loads(response.body, parse_constant=refuse)
    [row] = status["clients"]
    assert row["compute_s"] is None and row["utilization"] is None and row["wall_s"] == 1.0
    fleet.close()
