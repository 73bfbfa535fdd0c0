"""A region in a ``--peft`` run, in process (gRPC on port 0): the region hashes its ``--model
hf:PATH`` base and shows it upstream at Join (a global coordinator refuses a Join without it),
refuses its own clients whose base differs (naming both hashes), and relays the adapters to
clients of their own LoRA ranks (4 and 8 under ``svd``). One thread.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import grpc
import pytest
import torch
from shakespeare_data import tiny_llama
from test_peft_lora import _config, _Coordinator

from fedgrid.cli import serve
from fedgrid.cli.region import serve as serve_region
from fedgrid.client import start_client
from fedgrid.client.runtime import RpcFailed
from fedgrid.errors import ConfigError
from fedgrid.region import run_region
from fedgrid.region.upstream import RefusedUpstream
from fedgrid.runlog import read_metrics
from fedgrid.simulation.peft_lm import build_peft_lm
from fedgrid.simulation.run import run_simulation
from fedgrid.simulation.tasks import builtin_client, client_options

from harness import wait_until

PEFT8 = "lora:r=8,alpha=16,targets=q_proj,v_proj"


def _region_config(llama, data_dir, out: Path, upstream: str):
    return _config(
        llama,
        data_dir,
        out,
        peft=PEFT8,
        lora_aggregation="svd",
        listen="127.0.0.1:0",
        upstream=upstream,
        name="eu",
        min_clients=2,
        regional_rounds=1,
    )


def test_a_region_carries_the_base_hash_and_enforces_it_on_its_clients(llama, data_dir, tmp_path):
    top = _config(
        llama,
        data_dir,
        tmp_path / "global",
        peft=PEFT8,
        lora_aggregation="svd",
        listen="127.0.0.1:0",
        min_clients=1,
    )
    run = _Coordinator(top)
    region_config = _region_config(llama, data_dir, tmp_path / "eu", run.address)
    region = threading.Thread(target=serve_region, args=(region_config,), daemon=True)
    region.start()
    address_file = tmp_path / "eu" / "address"
    wait_until(lambda: address_file.exists() and address_file.read_text().strip(), timeout=60, what="address")
    address = address_file.read_text().strip()
    # A client of another base is refused by the region, both hashes named.
    other = tiny_llama(tmp_path / "other-llama", intermediate_size=48)
    stranger = builtin_client(
        0, 2, top.seed, client_options(_config(other, data_dir, tmp_path / "x", peft=PEFT8))
    )
    handle = start_client(stranger, address)
    with pytest.raises(Exception) as info:
        handle.join(timeout=60)
    ours = build_peft_lm(str(llama), PEFT8).base_hash
    assert "FAILED_PRECONDITION" in str(info.value) and ours in str(info.value), str(info.value)
    assert stranger.base_hash in str(info.value)
    # Clients of ranks 4 and 8 train the region's round; the region's update reaches the global run.
    ranked = _config(llama, data_dir, tmp_path / "y", peft=PEFT8, lora_aggregation="svd", peft_rank="4,8")
    clients = [builtin_client(i, 2, top.seed, client_options(ranked)) for i in range(2)]
    assert [c.lora_rank for c in clients] == [4, 8]
    handles = [start_client(client, address) for client in clients]
    final = run.finish()
    for h in handles:
        h.join(timeout=60)
    region.join(timeout=60)
    assert not region.is_alive()
    assert final["net.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"].shape == (
        8,
        32,
    )
    (row,) = read_metrics(tmp_path / "global")
    assert row["clients_ok"] == 1  # the region, one learner
    (lan,) = read_metrics(tmp_path / "eu")
    assert lan["clients_ok"] == 2
    # The simulated hierarchy (its region merging its clients' ranks with the run's svd) gives the same bits.
    simulated, history = run_simulation(
        _config(
            llama, data_dir, tmp_path / "sim", peft=PEFT8, lora_aggregation="svd", peft_rank="4,8", clients=2,
            hierarchy=True, regions="eu:1.0", regional_rounds=1,
        )
    )  # fmt: skip
    assert simulated is not None and list(simulated) == list(final) and history[-1].extra["lan_bytes_up"] > 0
    for name, tensor in simulated.items():
        assert torch.equal(final[name], tensor), name


def test_a_region_of_a_peft_run_needs_its_base(llama, data_dir, tmp_path):
    config = _region_config(llama, data_dir, tmp_path / "eu", "127.0.0.1:1")
    with pytest.raises(ConfigError) as info:
        run_region(config)  # no base hash given: fedgrid region hashes --model hf:PATH
    assert info.value.key == "model"


def test_a_region_of_another_base_is_refused_upstream_naming_both_hashes(llama, data_dir, tmp_path, caplog):
    # The global coordinator waits 2 s for a client that never comes, then ends with that error.
    top = _config(
        llama, data_dir, tmp_path / "global", peft=PEFT8, listen="127.0.0.1:0", min_clients=1, join_timeout_s=2.0
    )  # fmt: skip
    ended: dict[str, Exception] = {}

    def coordinate() -> None:
        try:
            serve(top)
        except Exception as exc:
            ended["error"] = exc

    coordinator = threading.Thread(target=coordinate, daemon=True)
    coordinator.start()
    upstream = tmp_path / "global" / "address"
    wait_until(lambda: upstream.exists() and upstream.read_text().strip(), timeout=60, what="address")
    other = tiny_llama(tmp_path / "other-llama", intermediate_size=48)
    config = _config(
        other, data_dir, tmp_path / "eu", peft=PEFT8, listen="127.0.0.1:0", upstream=upstream.read_text().strip(),
        name="eu", min_clients=1, regional_rounds=1,
    )  # fmt: skip
    stop = threading.Event()

    def run() -> None:
        try:
            serve_region(config, stop=stop)
        except Exception as exc:
            ended["region"] = exc

    region = threading.Thread(target=run, daemon=True)
    region.start()
    address_file = tmp_path / "eu" / "address"
    wait_until(lambda: address_file.exists() and address_file.read_text().strip(), timeout=60, what="address")
    # The region's own client (of the region's base) joins it; the region then joins upstream.
    client = builtin_client(0, 1, top.seed, client_options(config))
    handle = start_client(client, address_file.read_text().strip(), poll_wait_s=1.0)  # stops within 1 s
    try:
        # Joining again cannot change the base: the region ends by itself, naming the refusal.
        wait_until(
            lambda: not region.is_alive(), timeout=60, what="the region to end at the upstream refusal"
        )
        assert not stop.is_set()
    finally:
        handle.stop()
        with contextlib.suppress(RpcFailed):  # its region is gone: it may have given up first
            handle.join(timeout=60)
        stop.set()
        region.join(timeout=60)
        coordinator.join(timeout=60)
    assert "0 live clients" in str(ended.get("error")), ended  # no client ever joined it
    ours = build_peft_lm(str(llama), PEFT8).base_hash
    refused = ended["region"]
    assert isinstance(refused, RefusedUpstream) and refused.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "base model mismatch" in str(refused) and "joining again cannot change that" in str(refused)
    # The refusal names both (the coordinator's, last, cut to the message bound).
    assert client.base_hash in str(refused) and ours[:24] in str(refused) and ours != client.base_hash
    assert not region.is_alive() and not coordinator.is_alive()
