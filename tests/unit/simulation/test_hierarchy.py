"""``fedgrid simulate --hierarchy``: regions as tiers, in one process (``simulation.run._regions``)."""

from __future__ import annotations

import pytest
import torch

from fedgrid.config import load_config
from fedgrid.errors import ConfigError
from fedgrid.simulation.run import run_simulation

BASE = {
    "clients": 4,
    "rounds": 2,
    "seed": 3,
    "threads": 1,
    "engine": "sequential",
    "regions": "eu:0.5,us:0.5",
}


def test_one_regional_round_on_lossless_links_is_flat_fedavg():
    flat, _ = run_simulation(load_config(overrides=BASE))
    tiered, history = run_simulation(load_config(overrides={**BASE, "hierarchy": True, "regional_rounds": 1}))
    for name, tensor in flat.items():
        torch.testing.assert_close(
            tiered[name], tensor, atol=1e-6, rtol=0
        )  # a weighted mean of weighted means
    assert [m.clients_ok for m in history] == [2, 2]  # the global tier sees two regions
    assert history[0].extra["examples"] > 0


def test_each_link_has_its_codec_and_its_bytes():
    raw, raw_history = run_simulation(
        load_config(overrides={**BASE, "hierarchy": True, "regional_rounds": 2})
    )
    coded, history = run_simulation(
        load_config(
            overrides={**BASE, "hierarchy": True, "regional_rounds": 2, "lan_codec": "bf16", "codec": "int8"}
        )
    )
    for plain, m in zip(raw_history, history):
        for region in ("eu", "us"):
            # LAN: two clients x two regional rounds, bf16 halves each update; WAN: one int8 model a quarter of float32's.
            assert 0.45 < m.extra[f"lan_bytes_up.{region}"] / plain.extra[f"lan_bytes_up.{region}"] < 0.55
            assert 0.2 < m.extra[f"bytes_up.{region}"] / plain.extra[f"bytes_up.{region}"] < 0.3
            assert plain.extra[f"lan_bytes_up.{region}"] > 3.9 * plain.extra[f"bytes_up.{region}"]
    assert max(float((coded[n] - raw[n]).abs().max()) for n in raw) > 0  # the codecs ran
    assert history[-1].accuracy > 0.8


@pytest.mark.parametrize(
    "overrides, key", [({"strategy": "scaffold"}, "strategy"), ({"regions": ""}, "hierarchy")]
)
def test_a_hierarchy_that_cannot_work_is_refused_by_name(overrides, key):
    with pytest.raises(ConfigError) as info:
        run_simulation(load_config(overrides={**BASE, "hierarchy": True, **overrides}))
    assert info.value.key == key
