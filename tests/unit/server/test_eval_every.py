"""``eval_every``: the server-side evaluation runs every N rounds and after the last one."""

import pytest

from fedgrid.config import load_config
from fedgrid.errors import ConfigError
from fedgrid.simulation.run import run_simulation


def test_the_evaluation_runs_every_n_rounds_and_after_the_last():
    config = load_config(overrides={"rounds": 5, "clients": 2, "seed": 3, "eval_every": 2})
    _, history = run_simulation(config)
    # Digits' test-set accuracy comes from the server-side evaluation alone (a round without it
    # reports the clients' training loss as its loss).
    assert [m.round for m in history if m.accuracy is not None] == [2, 4, 5]
    _, every = run_simulation(load_config(overrides={"rounds": 5, "clients": 2, "seed": 3}))
    assert all(m.accuracy is not None for m in every)
    # The same training: the rounds evaluated in both runs report the same test loss and accuracy.
    for r in (2, 4, 5):
        assert (every[r - 1].loss, every[r - 1].accuracy) == (history[r - 1].loss, history[r - 1].accuracy)


@pytest.mark.parametrize("value", [0, -1])
def test_eval_every_below_one_is_named(value):
    with pytest.raises(ConfigError, match="eval_every.*at least 1"):
        load_config(overrides={"eval_every": value})
