"""Unit tests of the client halves of the training algorithms (``TorchClient`` + ``client/algorithms.py``).

Each algorithm is driven by the task its server half really sends (``configure_round`` and
``downlink_state`` of the strategy), so the two halves are checked against each other.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid.aggregation import BlockCoordinate, DiLoCo, FedProx, Scaffold, StreamingDiLoCo
from fedgrid.aggregation.scaffold import CONTROL_DELTA_PREFIX, CONTROL_PREFIX
from fedgrid.aggregation.selection import Sampling
from fedgrid.client.algorithms import FitContext
from fedgrid.client.torch_client import TorchClient
from fedgrid.types import ClientInfo, Failure, FitIns, FitRes, TensorSpec

X = torch.tensor([[1.0], [2.0]])
INFOS = [ClientInfo(client_id=f"c{i}", name=f"c{i}") for i in range(2)]


def _linear_client(**kw) -> TorchClient:
    """``y = w x`` on x = (1, 2), targets x: at w = 0 the MSE gradient is -5 (hand-computed)."""
    return TorchClient(
        nn.Linear(1, 1, bias=False),
        DataLoader(TensorDataset(X, X.clone()), batch_size=2),
        nn.functional.mse_loss,
        lambda params: torch.optim.SGD(params, lr=0.1),
        device="cpu",
        **kw,
    )


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _small_client(*, batch_size: int = 8, examples: int = 24, **kw) -> TorchClient:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(examples, 4, generator=g), torch.randint(0, 3, (examples,), generator=g))
    return TorchClient(
        _small_model(),
        DataLoader(data, batch_size=batch_size, shuffle=True),
        nn.functional.cross_entropy,
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        device="cpu",
        seed=3,
        name="small",
        **kw,
    )


def _global() -> "OrderedDict[str, torch.Tensor]":
    return OrderedDict((k, v.detach().clone()) for k, v in _small_model().state_dict().items())


def _task(strategy, server_round: int = 1) -> FitIns:
    return strategy.configure_round(server_round=server_round, clients=INFOS)[0][1]


# -- fedprox -------------------------------------------------------------------------------
def test_fedprox_hand_computed_two_steps():
    ins = FitIns(round=1, config={"algorithm": "fedprox", "proximal_mu": 1.0, "local_epochs": 2})
    out = _linear_client().fit(OrderedDict(weight=torch.zeros(1, 1)), ins)
    # step 1 at w = w_g = 0: the proximal gradient is 0, w = 0 - 0.1 * -5 = 0.5;
    # step 2: MSE gradient 2 (w - 1) mean(x^2) = -2.5, proximal mu (w - 0) = 0.5: w = 0.5 + 0.1 * 2.0
    assert out.state["weight"].item() == pytest.approx(0.7, abs=1e-6)
    plain = _linear_client().fit(
        OrderedDict(weight=torch.zeros(1, 1)), FitIns(round=1, config={"local_epochs": 2})
    )
    assert plain.state["weight"].item() == pytest.approx(0.75, abs=1e-6)


def test_fedprox_term_changes_the_update_and_mu_zero_is_fedavg():
    strategy = FedProx(sampling=Sampling(fit_config={"local_epochs": 3}), proximal_mu=0.5)
    strategy.initialize(initial_state=_global())
    ins = _task(strategy)
    assert ins.config["algorithm"] == "fedprox" and ins.config["proximal_mu"] == 0.5
    prox = _small_client().fit(_global(), ins)
    zero = _small_client().fit(_global(), FitIns(round=1, config={**ins.config, "proximal_mu": 0.0}))
    fedavg = _small_client().fit(
        _global(), FitIns(round=1, config={"local_epochs": 3, "round": 1, "seed": 0})
    )
    for name in zero.state:
        assert torch.equal(zero.state[name], fedavg.state[name]), name

    def drift(state):
        return sum(
            float((state[n] - _global()[n]).norm() ** 2) for n in state if state[n].is_floating_point()
        )

    assert drift(prox.state) < 0.9 * drift(zero.state)  # pulled towards the global model


# -- scaffold ------------------------------------------------------------------------------
def test_scaffold_correction_and_c_i_persist_hand_computed():
    client = _linear_client()
    ins = FitIns(round=1, config={"algorithm": "scaffold", "local_epochs": 1})
    download = OrderedDict(weight=torch.zeros(1, 1))
    download[CONTROL_PREFIX + "weight"] = torch.ones(1, 1)  # c = 1, c_i = 0 at first
    first = client.fit(download, ins)
    assert list(first.state) == ["weight", CONTROL_DELTA_PREFIX + "weight"]
    assert first.state["weight"].item() == pytest.approx(0.4, abs=1e-6)  # 0 - 0.1 * (-5 + 1 - 0)
    assert first.state[CONTROL_DELTA_PREFIX + "weight"].item() == pytest.approx(
        -5.0, abs=1e-6
    )  # c_i+ = mean grad
    assert client.algorithm("scaffold").control.c_i["weight"].item() == pytest.approx(-5.0, abs=1e-6)

    saved = client.state_dict()
    second = client.fit(download, FitIns(round=2, config=ins.config))
    assert second.state["weight"].item() == pytest.approx(-0.1, abs=1e-6)  # 0 - 0.1 * (-5 + 1 - (-5))
    assert second.state[CONTROL_DELTA_PREFIX + "weight"].item() == pytest.approx(0.0, abs=1e-6)

    resumed = _linear_client()  # a restarted client process with the saved state
    resumed.load_state_dict(saved)
    again = resumed.fit(download, FitIns(round=2, config=ins.config))
    for name in second.state:
        assert torch.equal(again.state[name], second.state[name]), name


def test_scaffold_upload_is_what_the_server_expects():
    strategy = Scaffold()
    strategy.initialize(initial_state=_global())
    ins = _task(strategy)
    download = strategy.downlink_state(server_round=1)
    assert any(n.startswith(CONTROL_PREFIX) for n in download)
    out = _small_client().fit(
        download, FitIns(round=1, config=ins.config)
    )  # over gRPC the client sees no `expected`
    assert ins.expected is not None
    assert TensorSpec.of(out.state) == ins.expected  # names, order, dtypes, shapes
    # BatchNorm's running statistics are controlled tensors without gradients: zero delta
    assert torch.count_nonzero(out.state[CONTROL_DELTA_PREFIX + "1.running_mean"]) == 0
    assert torch.count_nonzero(out.state[CONTROL_DELTA_PREFIX + "0.weight"]) > 0


# -- diloco --------------------------------------------------------------------------------
def test_diloco_runs_inner_steps_with_persistent_adamw():
    strategy = DiLoCo(inner_steps=7)
    strategy.initialize(initial_state=_global())
    ins = _task(strategy)
    client = _small_client(batch_size=10, examples=24)  # batches of 10, 10, 4
    out = client.fit(_global(), ins)
    # 7 steps cycle the loader (58 examples seen); the weight is the 24 distinct ones, what the
    # client reports at join: the coordinator refuses a claim above that (fleet/bounds.py).
    assert out.num_examples == 24 == client.num_examples
    short = _small_client(batch_size=10, examples=100).fit(_global(), _task(strategy))
    assert short.num_examples == 70  # 7 batches of 10, fewer than held
    opt = client.inner_optimizer
    assert isinstance(opt, torch.optim.AdamW)  # not the client's SGD factory
    steps = {int(s["step"]) for s in opt.state.values()}
    assert steps == {7}
    saved = client.state_dict()
    second = client.fit(_global(), FitIns(round=2, config={**ins.config, "round": 2}))
    assert client.inner_optimizer is opt and {int(s["step"]) for s in opt.state.values()} == {14}

    resumed = _small_client(batch_size=10, examples=24)
    resumed.load_state_dict(saved)
    again = resumed.fit(_global(), FitIns(round=2, config={**ins.config, "round": 2}))
    fresh = _small_client(batch_size=10, examples=24).fit(
        _global(), FitIns(round=2, config={**ins.config, "round": 2})
    )
    for name in second.state:
        assert torch.equal(again.state[name], second.state[name]), name
    assert not torch.equal(fresh.state["0.weight"], second.state["0.weight"])  # the state mattered


def _part(state, names):
    """What a fleet sends for ``FitIns.download = names``: those tensors, in model order."""
    return OrderedDict((n, t.clone()) for n, t in state.items() if names is None or n in names)


def _result(info, out):
    return FitRes(info, out.state, out.num_examples, dict(out.metrics))


def test_streaming_diloco_merges_one_fragment_and_uploads_one():
    strategy = StreamingDiLoCo(num_fragments=2, inner_steps=3)
    strategy.initialize(initial_state=_global())
    client = _small_client()
    first_ins = _task(strategy, 1)
    assert first_ins.download is None  # nobody has trained yet: the whole model
    out1 = client.fit(_global(), first_ins)
    assert first_ins.expected is not None and TensorSpec.of(out1.state) == first_ins.expected
    uploaded = set(strategy.fragment_of_round(1).names)
    assert set(out1.state) == uploaded and len(uploaded) < len(_global())
    strategy.aggregate(server_round=1, results=[_result(INFOS[0], out1)], failures=[])

    ins2 = _task(strategy, 2)
    merged = set(strategy.fragments[int(ins2.config["merge_fragment"])].names)
    assert ins2.download is not None and set(ins2.download) == merged  # the fragment synced in round 1, alone
    download = _part(strategy.global_state, ins2.download)
    poisoned = OrderedDict(
        (n, t + 100.0 if n not in merged and t.is_floating_point() else t)
        for n, t in strategy.global_state.items()
    )
    twin = _small_client()
    twin.load_state_dict(client.state_dict())
    a = client.fit(download, FitIns(round=2, config=ins2.config))  # the fragment only
    b = twin.fit(
        poisoned, FitIns(round=2, config=ins2.config)
    )  # the whole model, as before partial downloads
    for name in a.state:  # tensors outside the merged fragment come from the replica, not the download
        assert torch.equal(a.state[name], b.state[name]), name
    assert set(a.state) == set(strategy.fragment_of_round(2).names)


def test_streaming_diloco_client_that_missed_rounds_merges_every_fragment_it_missed():
    strategy = StreamingDiLoCo(num_fragments=3, inner_steps=2)
    strategy.initialize(initial_state=_global())
    client, other = _small_client(), _small_client()
    ins1 = _task(strategy, 1)
    strategy.aggregate(server_round=1, results=[_result(INFOS[0], client.fit(_global(), ins1))], failures=[])
    ins2 = strategy.configure_round(server_round=2, clients=INFOS[1:])[0][1]  # INFOS[0] misses round 2
    strategy.aggregate(server_round=2, results=[_result(INFOS[1], other.fit(_global(), ins2))], failures=[])

    ins3 = _task(strategy, 3)
    missed = [f for f in strategy.fragments if f.index in (1, 2)]  # synced in rounds 1 and 2
    assert ins3.download == tuple(n for f in missed for n in f.names)
    assert ins3.config["merge_fragment_prefixes"] == ",".join(p for f in missed for p in f.prefixes)
    replica = client.state_dict()["replica"]
    # The fleet adds the upload fragment (0) for an uplink that sends differences: it is not merged.
    download = _part(strategy.global_state, set(ins3.download) | set(strategy.fragment_of_round(3).names))
    ctx = FitContext(config=ins3.config, model=tuple(client.model.state_dict()))
    start = client.algorithm("streaming-diloco").start(download=download, ctx=ctx)
    assert list(start) == list(replica)
    for name, tensor in start.items():
        want = download[name] if name in ins3.download else replica[name]
        assert torch.equal(tensor, want), name
    assert not torch.equal(start["0.weight"], download["0.weight"])  # fragment 0: the replica's own training
    out = client.fit(download, ins3)
    assert set(out.state) == set(strategy.fragment_of_round(3).names)


def test_streaming_diloco_client_without_replica_refuses_part_of_the_model():
    strategy = StreamingDiLoCo(num_fragments=2, inner_steps=2)
    strategy.initialize(initial_state=_global())
    strategy.aggregate(
        server_round=1,
        results=[_result(INFOS[0], _small_client().fit(_global(), _task(strategy, 1)))],
        failures=[],
    )
    ins2 = _task(strategy, 2)
    restarted = _small_client()  # a new process without the saved state: no replica
    with pytest.raises(ValueError, match=r"download holds 7 of the model's 9 tensors .* keeps no replica"):
        restarted.fit(_part(strategy.global_state, ins2.download), ins2)
    # The failure reaches the strategy, which then sends the whole model; the client takes it all.
    strategy.aggregate(server_round=2, results=[], failures=[Failure(INFOS[0], "ValueError: no replica")])
    ins3 = _task(strategy, 3)
    assert ins3.download is None
    out = restarted.fit(_part(strategy.global_state, None), ins3)
    assert set(out.state) == set(strategy.fragment_of_round(3).names)
    with pytest.raises(ValueError, match="lacks 1 tensors the task says to merge"):
        restarted.fit(
            _part(strategy.global_state, ["0.weight"]),
            FitIns(round=4, config={**ins3.config, "merge_fragment_prefixes": "0"}),
        )


# -- bcd -----------------------------------------------------------------------------------
def test_bcd_trains_and_uploads_only_the_block():
    strategy = BlockCoordinate(
        sampling=Sampling(fit_config={"local_epochs": 2}), num_blocks=2, block_schedule="cyclic"
    )  # both blocks in one round
    strategy.initialize(initial_state=_global())
    tasks = strategy.configure_round(server_round=1, clients=INFOS)
    assert {int(ins.config["block"]) for _, ins in tasks} == {0, 1}
    for _, ins in tasks:
        block = strategy.blocks[int(ins.config["block"])]
        seen: list[list[torch.Tensor]] = []

        def factory(params):
            params = list(params)
            seen.append(params)
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)

        client = _small_client()
        client.optimizer_factory = factory
        download = _global()
        out = client.fit(download, ins)
        assert ins.expected is not None and TensorSpec.of(out.state) == ins.expected
        assert list(out.state) == list(block.names)
        after = client.model.state_dict()
        params = dict(client.model.named_parameters())
        block_params = [params[n] for n in block.names if n in params]
        assert [id(p) for p in seen[0]] == [
            id(p) for p in block_params
        ]  # optimizer state for the block alone
        for name, tensor in download.items():
            if name in block.names:
                if tensor.is_floating_point() and "running_var" not in name:
                    assert not torch.equal(after[name], tensor), name  # it trained
            else:
                assert torch.equal(after[name], tensor), (
                    name
                )  # frozen: bit-untouched, BatchNorm buffers included
        assert all(p.requires_grad for p in client.model.parameters())  # unfrozen again after the task
