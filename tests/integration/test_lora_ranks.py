"""Clients of different LoRA ranks (``peft_rank``, ``fedgrid.aggregation.lora_ranks``) on a tiny
Llama: over in-process gRPC two clients of ranks 4 and 8 beside a coordinator of rank 8 each
download and upload factors of their own shapes, the ``svd`` aggregate is the truncated SVD of
the weighted mean of their uploaded products, and the simulation ends bit-identical; an upload
whose shapes are not its announced rank's is refused; mixed ranks without ``svd`` are refused
at Join naming the key. One thread.
"""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta

import pytest
import torch
from test_peft_lora import LAYERS, _config, _Coordinator

from fedgrid.client import start_client
from fedgrid.client.api import FitOutput
from fedgrid.errors import ConfigError
from fedgrid.runlog import read_metrics
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.simulation.run import run_simulation
from fedgrid.simulation.tasks import builtin_client, client_options
from fedgrid.types import FitIns

PEFT8 = "lora:r=8,alpha=16,targets=q_proj,v_proj"
PAIRS = [
    (f"net.base_model.model.model.layers.{i}.self_attn.{p}.lora_A.default.weight",
     f"net.base_model.model.model.layers.{i}.self_attn.{p}.lora_B.default.weight")
    for i in range(LAYERS)
    for p in ("q_proj", "v_proj")
]  # fmt: skip


def _ranked(llama, data_dir, out, **overrides):
    return _config(
        llama,
        data_dir,
        out,
        **{"peft": PEFT8, "peft_rank": "4,8", "lora_aggregation": "svd", "rounds": 2, **overrides},
    )


def _recorded(client):
    """``client`` with the model of each fit it was given and the factors it returned recorded."""
    seen: list[tuple[dict, dict, int]] = []
    fit = client.fit

    def recording(state, ins):
        down = {k: v.clone() for k, v in state.items()}
        out = fit(state, ins)
        seen.append((down, {k: v.clone() for k, v in out.state.items()}, out.num_examples))
        return out

    client.fit = recording
    return client, seen


def _truncated(product: torch.Tensor, rank: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(product, full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vh[:rank]


def test_clients_of_ranks_4_and_8_train_their_own_shapes_and_svd_merges_their_products(
    llama, data_dir, tmp_path
):
    config = _ranked(
        llama, data_dir, tmp_path / "grpc", listen="127.0.0.1:0", min_clients=2, fraction_evaluate=1.0
    )
    run = _Coordinator(config)
    clients = [_recorded(builtin_client(i, 2, config.seed, client_options(config))) for i in range(2)]
    assert [c.lora_rank for c, _ in clients] == [4, 8]
    handles = [start_client(client, run.address) for client, _ in clients]
    deployed = run.finish()
    for handle in handles:
        handle.join(timeout=60)
    for (_, seen), rank in zip(clients, (4, 8)):
        assert len(seen) == 2
        for down, up, _ in seen:  # each client downloads and uploads factors of its own rank
            for a, b in PAIRS:
                assert down[a].shape == up[a].shape == (rank, 32), (a, down[a].shape)
                assert down[b].shape == up[b].shape == (32, rank), (b, down[b].shape)
    # Round 2's download at rank 4 is the rank-4 truncated SVD of round 1's aggregate (the same
    # model the rank-8 client downloads whole).
    round2_full, round2_small = clients[1][1][1][0], clients[0][1][1][0]
    for a, b in PAIRS:
        want = _truncated(round2_full[b].double() @ round2_full[a].double(), 4)
        got = round2_small[b].double() @ round2_small[a].double()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # The final model: the truncated SVD to rank 8 of the weighted mean of round 2's products.
    (_, up4, n4), (_, up8, n8) = clients[0][1][1], clients[1][1][1]
    for a, b in PAIRS:
        mean = (n4 * up4[b].double() @ up4[a].double() + n8 * up8[b].double() @ up8[a].double()) / (n4 + n8)
        assert deployed[a].shape == (8, 32) and deployed[b].shape == (32, 8)
        got = deployed[b].double() @ deployed[a].double()
        torch.testing.assert_close(got, _truncated(mean, 8), rtol=1e-5, atol=1e-7)
    # The simulation of the same run gives the same bits.
    simulated, history = run_simulation(_ranked(llama, data_dir, tmp_path / "sim", fraction_evaluate=1.0))
    assert simulated is not None and list(simulated) == list(deployed)
    for name, tensor in simulated.items():
        assert torch.equal(deployed[name], tensor), name
    assert history[-1].clients_ok == 2
    # Each client evaluated the model at its own rank, over gRPC as in the simulation.
    assert [row["clients_evaluated"] for row in read_metrics(tmp_path / "grpc")] == [2, 2]
    assert [m.extra["clients_evaluated"] for m in history] == [2, 2]


def _liar(config):
    """Client 0 (rank 4), uploading its factors padded to rank 8."""
    liar = builtin_client(0, 2, config.seed, client_options(config))
    assert liar.lora_rank == 4
    fit = liar.fit

    def rank8_factors(state, ins):
        out = fit(state, ins)
        padded = OrderedDict(
            (k, torch.cat([v, torch.zeros_like(v)], dim=0 if ".lora_A." in k else 1))
            for k, v in out.state.items()
        )
        return FitOutput(padded, out.num_examples, out.metrics)

    liar.fit = rank8_factors
    return liar


def test_an_upload_of_other_shapes_than_its_announced_rank_is_refused_over_grpc(llama, data_dir, tmp_path):
    config = _ranked(llama, data_dir, tmp_path / "grpc", listen="127.0.0.1:0", min_clients=2, rounds=1)
    run = _Coordinator(config)
    honest, seen = _recorded(builtin_client(1, 2, config.seed, client_options(config)))
    handles = [start_client(client, run.address) for client in (_liar(config), honest)]
    final = run.finish()
    for handle in handles:
        handle.join(timeout=60)
    (row,) = read_metrics(tmp_path / "grpc")
    assert row["clients_ok"] == 1 and row["clients_failed"] == 1
    ((_, up, _),) = seen  # the aggregate is the honest client's alone
    for a, b in PAIRS:
        want = up[b].double() @ up[a].double()
        torch.testing.assert_close(final[b].double() @ final[a].double(), want, rtol=1e-5, atol=1e-7)


def test_an_upload_of_other_shapes_than_its_announced_rank_is_refused(llama, data_dir, tmp_path):
    config = _ranked(llama, data_dir, tmp_path / "sim")
    liar = _liar(config)
    fleet = InProcessFleet([liar])
    (info,) = fleet.wait_for_clients(min_clients=1, timeout=timedelta(seconds=1))
    model = builtin_client(1, 2, config.seed, client_options(config)).model
    global_state = OrderedDict((k, v.clone()) for k, v in model.state_dict().items())
    outcome = fleet.fit_round(
        server_round=1,
        global_state=global_state,
        assignments=[(info, FitIns(round=1, config={"lr": 0.01, "local_epochs": 1}))],
        timeout=timedelta(seconds=60),
    )
    assert outcome.results == [] and len(outcome.failures) == 1
    reason = outcome.failures[0].reason
    assert "InvalidUpdateError" in reason and "[4, 32]" in reason.replace("(", "[").replace(")", "]"), reason


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"peft_rank": "4,8"}, "lora_aggregation"),  # factors: one shape
        ({"peft_rank": "4", "lora_aggregation": "ffa"}, "lora_aggregation"),
        ({"peft_rank": "0", "lora_aggregation": "svd"}, "peft_rank"),
        ({"peft_rank": "16", "lora_aggregation": "svd"}, "peft_rank"),
        ({"peft_rank": "4,x", "lora_aggregation": "svd"}, "peft_rank"),
        ({"peft_rank": "4", "peft": "", "lora_aggregation": None}, "peft_rank"),
    ],
)
def test_bad_ranks_are_refused_naming_the_key(llama, data_dir, tmp_path, overrides, key):
    with pytest.raises(ConfigError) as info:
        _config(llama, data_dir, tmp_path, **{"peft": PEFT8, **overrides})
    assert info.value.key == key, str(info.value)


def test_a_client_of_another_rank_is_refused_at_join_without_svd(llama, data_dir, tmp_path):
    config = _config(llama, data_dir, tmp_path / "run", peft=PEFT8, listen="127.0.0.1:0", min_clients=1)
    small = _ranked(llama, data_dir, tmp_path / "unused")
    run = _Coordinator(config)
    handle = start_client(builtin_client(0, 1, config.seed, client_options(small)), run.address)
    with pytest.raises(Exception) as info:
        handle.join(timeout=60)
    text = str(info.value)
    assert "FAILED_PRECONDITION" in text and "lora_aggregation" in text and "rank 4" in text, text
    handle = start_client(builtin_client(0, 1, config.seed, client_options(config)), run.address)
    assert run.finish()[PAIRS[0][0]].shape == (8, 32)
    handle.join(timeout=60)


@pytest.mark.parametrize("codec", ["topk:0.25", "int8"])
def test_clients_of_their_own_ranks_take_lossy_uplinks_and_evaluate_at_their_rank(
    llama, data_dir, tmp_path, codec
):
    # A difference is taken against the client's own download; federated evaluation sends each
    # client the model at its rank.
    final, history = run_simulation(
        _ranked(llama, data_dir, tmp_path / "sim", codec=codec, fraction_evaluate=1.0)
    )
    assert final is not None and final[PAIRS[0][0]].shape == (8, 32)
    assert [m.clients_ok for m in history] == [2, 2]
    assert all(m.clients_failed == 0 for m in history)
    assert [m.extra.get("clients_evaluated") for m in history] == [2, 2]
    assert any(b.abs().sum() > 0 for name, b in final.items() if ".lora_B." in name)
