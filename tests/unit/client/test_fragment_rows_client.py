"""The client half of streaming DiLoCo when a fragment holds row slices of a tensor
(``blocks.row_slice_name``): the download's slices go into those rows of the replica (with
``merge_alpha``) and the upload sends the rows of the task's fragment."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid.aggregation import StreamingDiLoCo
from fedgrid.client.algorithm_math import merge, names_under
from fedgrid.client.algorithms import FitContext
from fedgrid.client.torch_client import TorchClient
from fedgrid.types import ClientInfo, FitRes, TensorSpec

INFO = ClientInfo(client_id="c0", name="c0")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))  # 0.weight: 128 of 195 parameters


def _client() -> TorchClient:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(24, 8, generator=g), torch.randint(0, 3, (24,), generator=g))
    return TorchClient(
        _model(),
        DataLoader(data, batch_size=8, shuffle=True),
        nn.functional.cross_entropy,
        lambda params: torch.optim.SGD(params, lr=0.1),
        device="cpu",
        seed=3,
        name="c0",
    )


def _strategy() -> StreamingDiLoCo:
    strategy = StreamingDiLoCo(num_fragments=2, inner_steps=2, merge_alpha=0.5)
    strategy.initialize(initial_state=OrderedDict((k, v.clone()) for k, v in _model().state_dict().items()))
    return strategy


def test_fragments_of_the_test_model_split_the_first_layer():
    first, second = _strategy().fragments
    # 195 parameters, a fair share of 97.5: 12 rows of 8 (96) is the nearest cut.
    assert first.names == ("0.weight#rows=0:12",)
    assert second.names == ("0.weight#rows=12:16", "0.bias", "2.weight", "2.bias")


def test_fit_with_slices_merges_and_uploads_the_right_rows():
    strategy, client = _strategy(), _client()
    ins1 = strategy.configure_round(server_round=1, clients=[INFO])[0][1]
    sent1 = strategy.downlink_state(server_round=1)  # the whole model, 0.weight as two slices
    out1 = client.fit(OrderedDict((n, t.clone()) for n, t in sent1.items()), ins1)
    assert ins1.expected is not None and TensorSpec.of(out1.state) == ins1.expected  # fragment 1
    replica = client.state_dict()["replica"]
    assert list(replica) == list(client.model.state_dict())  # joined: whole tensors
    assert torch.equal(out1.state["0.weight#rows=12:16"], replica["0.weight"][12:16])
    assert torch.equal(out1.state["2.weight"], replica["2.weight"])
    strategy.aggregate(server_round=1, results=[FitRes(INFO, out1.state, 24)], failures=[])

    ins2 = strategy.configure_round(server_round=2, clients=[INFO])[0][1]
    assert ins2.download == ("0.weight#rows=12:16", "0.bias", "2.weight", "2.bias")  # synced in round 1
    sent2 = strategy.downlink_state(server_round=2)
    download = OrderedDict((n, sent2[n].clone()) for n in ins2.download)
    ctx = FitContext(config=ins2.config, model=tuple(client.model.state_dict()))
    start = client.algorithm("streaming-diloco").start(download=download, ctx=ctx)
    # alpha = 0.5: the synced rows are lerp(global, replica, 0.5); rows 0:12 stay the replica's own.
    w = start["0.weight"]
    assert torch.equal(w[:12], replica["0.weight"][:12])
    assert torch.equal(w[12:], torch.lerp(download["0.weight#rows=12:16"], replica["0.weight"][12:], 0.5))
    assert not torch.equal(w[12:], download["0.weight#rows=12:16"])
    assert torch.equal(start["2.bias"], torch.lerp(download["2.bias"], replica["2.bias"], 0.5))

    out2 = client.fit(download, ins2)  # fragment 0: rows 0:12 of the first layer, alone
    assert list(out2.state) == ["0.weight#rows=0:12"]
    assert torch.equal(out2.state["0.weight#rows=0:12"], client.state_dict()["replica"]["0.weight"][:12])


def test_merge_with_alpha_zero_replaces_rows_bit_for_bit_and_leaves_the_replica_alone():
    local = OrderedDict(w=torch.arange(8.0).reshape(4, 2), b=torch.zeros(2))
    download = OrderedDict([("w#rows=1:3", torch.full((2, 2), -1.0))])
    merged = merge(local, download, ["w#rows=1:3"], 0.0)
    assert torch.equal(merged["w"], torch.tensor([[0.0, 1.0], [-1.0, -1.0], [-1.0, -1.0], [6.0, 7.0]]))
    assert torch.equal(local["w"], torch.arange(8.0).reshape(4, 2)) and merged["b"] is local["b"]
    assert names_under(["w", "b"], "w#rows=1:3,b", key="k") == ["w#rows=1:3", "b"]
