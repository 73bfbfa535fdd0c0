"""A digits run through ``run_simulation`` ends with the same model on the batched and the
sequential engine, within ``fedgrid.determinism.BATCHED_ATOL`` (the two accumulate float
sums in different orders; see that module).

With ``test_parity.py`` (``fedgrid simulate``, engine ``auto`` = batched for the digits MLP,
against a coordinator and client processes) this ties the batched engine to deployment.
"""

from __future__ import annotations

import pytest
import torch

from fedgrid.config import load_config
from fedgrid.determinism import BATCHED_ATOL
from fedgrid.simulation.run import run_simulation
from fedgrid.simulation.tasks import resolve

BASE = {"rounds": 2, "clients": 4, "seed": 3, "local_epochs": 1, "progress": False}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: a second OpenMP thread only adds wake-ups (slow on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "options",
    [
        {
            "codec": "topk:0.1"
        },  # SGD with momentum (the digits default), compressed uplink with error feedback
        {"optimizer": "adam", "lr": 0.01, "weight_decay": 0.001},
        {"strategy": "fedprox", "proximal_mu": 0.1},
        {"strategy": "scaffold"},
        {"strategy": "bcd", "num_blocks": 2},
        {"strategy": "diloco", "inner_steps": 3},  # trains through TorchClient.fit inside the batched engine
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_digits_run_batched_equals_sequential(options):
    runs = {}
    for engine in ("batched", "sequential"):
        config = load_config(overrides={**BASE, **options, "engine": engine})
        runs[engine] = run_simulation(config)
    (final_b, history_b), (final_s, history_s) = runs["batched"], runs["sequential"]
    assert list(final_b) == list(final_s)
    for name, tensor in final_s.items():
        torch.testing.assert_close(final_b[name], tensor, atol=BATCHED_ATOL, rtol=0)
    initial = resolve(dataset="digits", seed=BASE["seed"]).initial_state
    assert any(not torch.equal(final_s[name], initial[name]) for name in initial)  # the runs trained
    for mb, ms in zip(history_b, history_s, strict=True):
        assert (mb.bytes_up, mb.bytes_down, mb.clients_ok, mb.clients_failed) == (
            ms.bytes_up,
            ms.bytes_down,
            ms.clients_ok,
            ms.clients_failed,
        )
        assert (ms.clients_ok, ms.clients_failed) == (BASE["clients"], 0)
        assert mb.loss == pytest.approx(ms.loss, abs=1e-5)
