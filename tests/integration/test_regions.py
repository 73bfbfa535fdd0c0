"""Regions: ``fedgrid region`` coordinates its clients and joins the global coordinator as one client.

With H = 1 regional round per global round and lossless links, a hierarchy of two regions
of two clients each is flat FedAvg over the four clients (a weighted mean of weighted means),
up to float rounding; its bytes are counted per link (LAN in each region's run directory,
WAN in the global one, per region).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from fedgrid.config import load_config
from fedgrid.runlog import load_model, read_metrics
from fedgrid.simulation.run import run_simulation

from harness import FEDGRID, REFERENCE, THREADS, child_env, start_client, start_coordinator, wait_until

ROUNDS, SEED = 2, 3
#: A weighted mean of weighted means against one weighted mean, in float32 tensors summed in float64.
TOLERANCE = 1e-6


def start_region(out: Path, upstream: str, name: str, *args: str) -> tuple[subprocess.Popen, str]:
    """``fedgrid region`` on port 0; returns it with its address (``RUN_DIR/address``)."""
    log = open(out.parent / f"{out.name}.log", "w")
    proc = subprocess.Popen([*FEDGRID, "region", "--upstream", upstream, "--name", name, "--listen", "127.0.0.1:0", "--out", str(out),
                             "--threads", str(THREADS), "--seed", str(SEED), *args], stdout=log, stderr=subprocess.STDOUT, env=child_env())
    address = out / "address"
    wait_until(lambda: address.exists() and address.read_text().strip() != "" or proc.poll() is not None, timeout=60, what=f"region {name}'s address")
    assert proc.poll() is None, (out.parent / f"{out.name}.log").read_text()
    return proc, address.read_text().strip()


@pytest.mark.timeout(300)
def test_two_regions_with_one_regional_round_are_flat_fedavg(tmp_path):
    top = tmp_path / "global"
    coordinator, address = start_coordinator(top, "--rounds", str(ROUNDS), "--min-clients", "2", "--seed", str(SEED))
    procs = [coordinator]
    try:
        for r, name in enumerate(("region-a", "region-b")):
            region, region_address = start_region(tmp_path / name, address, name, "--min-clients", "2", "--regional-rounds", "1")
            procs.append(region)
            for i in (2 * r, 2 * r + 1):
                procs.append(start_client(region_address, tmp_path / f"client{i}.log", "--partition", f"{i}/4", "--seed", str(SEED)))
        for proc in procs[::-1]:
            assert proc.wait(timeout=240) == 0, [p.read_text()[-3000:] for p in sorted(tmp_path.glob("*.log"))]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()

    flat, _ = run_simulation(load_config(overrides={"rounds": ROUNDS, "clients": 4, "seed": SEED, "out": str(tmp_path / "flat"), **REFERENCE}))
    hierarchical = load_model(top / "model.safetensors")
    for name, tensor in flat.items():
        torch.testing.assert_close(hierarchical[name], tensor, atol=TOLERANCE, rtol=0)

    top_metrics = read_metrics(top)
    assert [m["clients_ok"] for m in top_metrics] == [2, 2] and [m["examples"] for m in top_metrics][0] > 0
    for name in ("region-a", "region-b"):
        lan = read_metrics(tmp_path / name)
        assert [m["round"] for m in lan] == [1, 2] and all(m["clients_ok"] == 2 for m in lan)
        wan = [json.loads(line) for line in (tmp_path / name / "wan.jsonl").read_text().splitlines()]
        assert [w["round"] for w in wan] == [1, 2]
        for g, w, m in zip(top_metrics, wan, lan):
            # Each tier counts its own links: the global coordinator a region's WAN bytes, the region its LAN's.
            assert abs(w["bytes_up"] - g[f"bytes_up.{name}"]) <= 400 and abs(g[f"bytes_down.{name}"] - w["bytes_down"]) <= 400
            assert m["bytes_up"] > 1.9 * g[f"bytes_up.{name}"]  # two clients' updates in, one regional model out
        assert g[f"bytes_up.{name}"] > 4 * 4000
