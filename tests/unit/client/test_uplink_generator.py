"""A stochastic codec's draws (``randk``, ``qsgd``) come from a generator of the upload's own,
seeded from the task's seed, the round and the client's name: never from torch's default
generator, whose state depends on whatever else the process drew (a rerun of ``fedgrid
simulate --codec randk:0.1`` ended on another model before)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from fedgrid.client.uplink import UplinkEncoder
from fedgrid.compression.spec import CodecSpec
from fedgrid.config import load_config
from fedgrid.simulation.run import run_simulation

GLOBAL = OrderedDict(w=torch.zeros(64, 32), b=torch.zeros(32))
NEW = OrderedDict(w=torch.linspace(-1, 1, 64 * 32).reshape(64, 32), b=torch.linspace(0, 1, 32))


def _payloads(codec: str, *, round_: int, client: str, default_seed: int) -> list[bytes]:
    torch.manual_seed(default_seed)  # what the process drew before: must not matter
    uplink = UplinkEncoder(CodecSpec.parse(codec)).begin(round_, {"seed": 7}, client)
    encoded, delta = uplink.encode(global_state=GLOBAL, new_state=NEW)
    assert delta
    return [bytes(payload) for _, _, payload in encoded.payloads()]


@pytest.mark.parametrize("codec", ["randk:0.1", "qsgd:32", "randk:0.1+zstd", "randk", "qsgd:32+zstd"])
def test_a_stochastic_codec_draws_from_the_task_round_and_client(codec):
    first = _payloads(codec, round_=3, client="digits-0001/4", default_seed=1)
    assert _payloads(codec, round_=3, client="digits-0001/4", default_seed=2) == first
    assert _payloads(codec, round_=4, client="digits-0001/4", default_seed=1) != first
    assert _payloads(codec, round_=3, client="digits-0002/4", default_seed=1) != first


def test_a_simulation_with_randk_ends_on_the_same_model_twice(tmp_path):
    models = []
    for i in range(2):
        torch.manual_seed(100 + i)  # the default generator differs between the two runs
        config = load_config(
            overrides={
                "rounds": 2,
                "clients": 4,
                "seed": 5,
                "codec": "randk:0.1",
                "out": str(tmp_path / f"r{i}"),
            }
        )
        model, _ = run_simulation(config)
        models.append(model)
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
