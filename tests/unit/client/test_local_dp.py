"""Local DP for TorchClient through Opacus: per-example clipping and noise at every step, the
epsilon it spent in the fit metrics, kept across a client restore (issue 28)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from opacus.accountants import RDPAccountant
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid.client.local_dp import LOCAL_EPSILON, LocalDP
from fedgrid.client.torch_client import TorchClient
from fedgrid.types import FitIns

N, BATCH = 64, 16


def _client(local_dp: LocalDP | None, *, lr: float = 0.1) -> TorchClient:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 5, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    return TorchClient(
        model,
        DataLoader(TensorDataset(x, y), batch_size=BATCH),
        nn.functional.cross_entropy,
        lambda params: torch.optim.SGD(params, lr=lr),
        device="cpu",
        name="dp-client",
        local_dp=local_dp,
    )


def _fit(client: TorchClient, state, round_: int = 1):
    return client.fit(state, FitIns(round=round_, config={"local_epochs": 1, "seed": 3}))


def test_each_step_is_clipped_per_example_and_noised_reproducibly():
    start = OrderedDict((k, v.clone()) for k, v in _client(None).model.state_dict().items())
    plain = _fit(_client(None), start)
    private = _fit(_client(LocalDP(noise_multiplier=1.0, max_grad_norm=0.01)), start)
    again = _fit(_client(LocalDP(noise_multiplier=1.0, max_grad_norm=0.01)), start)
    for name in start:
        assert torch.equal(private.state[name], again.state[name]), name  # seeded by the task's round seed
    # Four steps of lr 0.1 whose clipped mean gradient is at most 0.01 and whose noise std is
    # 0.01 / 16 per coordinate: the model moves far less than without DP.
    moved = sum((private.state[n] - start[n]).norm() ** 2 for n in start) ** 0.5
    moved_plain = sum((plain.state[n] - start[n]).norm() ** 2 for n in start) ** 0.5
    assert moved < 0.1 * moved_plain
    direct = RDPAccountant()
    for _ in range(N // BATCH):
        direct.step(noise_multiplier=1.0, sample_rate=BATCH / N)
    assert private.metrics[LOCAL_EPSILON] == pytest.approx(direct.get_epsilon(1e-5))
    assert LOCAL_EPSILON not in plain.metrics


def test_the_local_budget_survives_a_client_restore():
    client = _client(LocalDP(noise_multiplier=1.0, max_grad_norm=1.0))
    state = client.model.state_dict()
    first = _fit(client, state).metrics[LOCAL_EPSILON]
    restored = _client(LocalDP(noise_multiplier=1.0, max_grad_norm=1.0))
    restored.load_state_dict(client.state_dict())
    second = _fit(restored, state, round_=2).metrics[LOCAL_EPSILON]
    assert second > first > 0 and restored.local_dp.accountant.history == [(1.0, BATCH / N, 2 * N // BATCH)]


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"noise_multiplier": 0.0, "max_grad_norm": 1.0}, "noise_multiplier"),
        ({"noise_multiplier": 1.0, "max_grad_norm": -1.0}, "max_grad_norm"),
        ({"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1.0}, "delta"),
    ],
)
def test_bad_local_dp_settings_are_named(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        LocalDP(**kwargs)
