"""DP-FedAvg's arithmetic: clipping, the secure Gaussian noise (its std measured) and the adaptive clip (issue 28)."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch

from fedgrid.aggregation.privacy import (
    CLIP_LEARNING_RATE,
    clip_update,
    next_clip,
    noise_share,
    split_noise,
    stream_key,
)

KEY = bytes(range(32))


def test_an_update_is_scaled_to_the_clip_and_a_short_one_is_kept():
    update = OrderedDict(w=torch.tensor([3.0, 0.0]), b=torch.tensor([4.0]), n=torch.tensor([7]))
    clipped, norm = clip_update(update, 1.0)
    assert norm == 5.0
    assert torch.allclose(clipped["w"], torch.tensor([0.6, 0.0])) and torch.allclose(
        clipped["b"], torch.tensor([0.8])
    )
    assert clipped["n"].item() == 7  # integer tensors are neither counted nor clipped
    kept, norm = clip_update(update, 5.0)
    assert norm == 5.0 and torch.equal(kept["w"], update["w"]) and torch.equal(kept["b"], update["b"])
    with pytest.raises(ValueError, match="clip must be a finite number above 0"):
        clip_update(update, 0.0)


def test_the_noise_has_the_std_asked_for_and_is_standard_normal():
    like = OrderedDict(a=torch.zeros(400_000), b=torch.zeros(100, 1000, dtype=torch.float64))
    noise = noise_share(KEY, 1, like, std=0.75)
    z = torch.cat([noise["a"].double(), noise["b"].reshape(-1)])
    # 500,000 draws: the std's standard error is 0.75 / sqrt(2 * 5e5) = 7.5e-4, the mean's 1.1e-3.
    assert z.std().item() == pytest.approx(0.75, abs=4e-3)
    assert abs(z.mean().item()) < 5e-3
    assert ((z.abs() < 0.75).double().mean().item()) == pytest.approx(0.6827, abs=3e-3)  # one sigma
    assert ((z.abs() < 1.5).double().mean().item()) == pytest.approx(0.9545, abs=2e-3)  # two sigma
    assert noise["a"].dtype == torch.float32 and noise["b"].dtype == torch.float64


def test_the_noise_is_the_key_s_and_the_round_s_alone():
    like = OrderedDict(w=torch.zeros(1000), step=torch.tensor(3))
    first = noise_share(KEY, 4, like, std=1.0)
    assert set(first) == {"w"}  # no noise on integer tensors
    assert torch.equal(first["w"], noise_share(KEY, 4, like, std=1.0)["w"])  # reproducible with the key
    assert not torch.equal(first["w"], noise_share(KEY, 5, like, std=1.0)["w"])
    assert not torch.equal(first["w"], noise_share(bytes(32), 4, like, std=1.0)["w"])
    assert stream_key(KEY, "update", 4) != stream_key(KEY, "count", 4)
    with pytest.raises(ValueError, match="at least 32 bytes"):
        noise_share(b"short", 1, like, std=1.0)


def test_shares_of_n_parties_sum_to_the_noise_of_one():
    like = OrderedDict(w=torch.zeros(200_000))
    keys = [bytes([i]) * 32 for i in range(4)]
    total = sum(noise_share(k, 1, like, std=2.0, parties=4)["w"].double() for k in keys)
    assert total.std().item() == pytest.approx(2.0, abs=0.02)


def test_the_adaptive_clip_moves_geometrically_towards_the_median_norm():
    # All unclipped: the clip was too large and shrinks; none: it grows; half: it stays.
    assert next_clip(1.0, 10, 10, 0.0) == pytest.approx(math.exp(-CLIP_LEARNING_RATE * 0.5))
    assert next_clip(1.0, 0, 10, 0.0) == pytest.approx(math.exp(CLIP_LEARNING_RATE * 0.5))
    assert next_clip(2.0, 5, 10, 0.0) == 2.0
    assert next_clip(2.0, 5, 10, 1.0) < 2.0  # the count's noise moves it as a count would


def test_the_noise_split_composes_to_the_noise_multiplier():
    sigma_update, sigma_count = split_noise(1.0, 100)
    assert sigma_count == 5.0  # Andrew et al.'s n / 20
    assert (sigma_update**-2 + (2 * sigma_count) ** -2) ** -0.5 == pytest.approx(1.0)
    sigma_update, sigma_count = split_noise(1.0, 4)  # few clients: the count never takes more than a quarter
    assert sigma_count == 1.0 and sigma_update == pytest.approx(1 / math.sqrt(0.75))
