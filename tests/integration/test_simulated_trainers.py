"""``fedgrid.integrations.simulated``: a trainer that owns its loop (here a plain torch loop on the
digits MLP, driving ``Federation`` as the callbacks do) as a client of the simulation. A trainer
that fails is its round's failure, named, and the run goes on with the others; one that stops
before its round's steps is reported failed like a deployed one; each client's random generators
are its own (one process per site), whatever order the fleet runs them in."""

from __future__ import annotations

import torch
from torch import nn

from fedgrid.config import load_config
from fedgrid.integrations.federation import Federation
from fedgrid.integrations.simulated import TrainerClient, simulate
from fedgrid.simulation.catalog import build_model

from harness import THREADS


def _loop(steps: int, seed: int, draws: list | None = None, fail: bool = False):
    """A site's own training loop of at most ``steps`` optimizer steps on random digits-shaped data."""

    def train(connection) -> None:
        if fail:
            raise RuntimeError("the site's data folder is missing")
        torch.manual_seed(seed)
        model: nn.Module = build_model("digits", "", "", "", None)
        federation = Federation(connection, prefix="")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        federation.begin(model, steps_per_epoch=4, examples_per_step=8, num_examples=32)
        try:
            for _ in range(steps):
                x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
                if draws is not None:
                    draws.append(float(x[0, 0]))
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                federation.after_backward()
                optimizer.step()
                if not federation.step(loss=float(loss)):
                    break
        finally:
            federation.end()

    return train


def _config(rounds: int):
    return load_config(
        overrides={"rounds": rounds, "local_epochs": 1, "threads": THREADS, "seed": 0, "out": ""}
    )


def test_a_trainer_that_fails_is_its_rounds_failure_and_the_run_goes_on():
    clients = [
        TrainerClient(_loop(100, seed=0), name="site-0", num_examples=32),
        TrainerClient(_loop(100, seed=1, fail=True), name="site-1", num_examples=32),
    ]
    final, history = simulate(_config(rounds=2), clients)
    assert [(m.clients_ok, m.clients_failed) for m in history] == [(1, 1), (1, 1)]
    assert isinstance(clients[1].error, RuntimeError)
    assert final is not None and set(final) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_a_trainer_that_stops_before_its_rounds_steps_fails_that_round():
    # 6 steps: round 1's 4 steps, then 2 of round 2's 4 (FedAvg: one epoch of 4 steps a round).
    clients = [TrainerClient(_loop(6, seed=0), name="site-0", num_examples=32)]
    _, history = simulate(_config(rounds=3), clients)
    assert [(m.round, m.clients_ok) for m in history[:1]] == [(1, 1)]
    assert all(m.clients_ok == 0 for m in history[1:]), history


def test_each_simulated_client_draws_from_its_own_random_generators():
    """Two sites seeded alike draw the same numbers, though the fleet interleaves their rounds
    (as two processes would); without their own generators the second would go on from the first's."""
    draws: list[list[float]] = [[], []]
    clients = [
        TrainerClient(_loop(100, seed=7, draws=draws[k]), name=f"site-{k}", num_examples=32) for k in range(2)
    ]
    _, history = simulate(_config(rounds=3), clients)
    assert [m.clients_ok for m in history] == [2, 2, 2]
    assert len(draws[0]) == 12 and draws[0] == draws[1]
