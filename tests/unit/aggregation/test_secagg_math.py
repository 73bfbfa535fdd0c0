"""SecAgg+ arithmetic: Shamir, the neighbour graph, the ring quantization, the PRG, and whole
rounds with seeded random dropouts at every step, whose sums must be exact."""

from __future__ import annotations

import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from secagg_sim import Federation, random_drops

from fedgrid.aggregation.secagg_math import (
    SecAggAbortedError,
    combine_shares,
    default_neighbours,
    dequantize,
    from_wire,
    neighbours,
    prg,
    quantize,
    ring_add,
    ring_scale,
    share_secret,
    to_wire,
)


def test_shamir_any_threshold_subset_recovers_the_secret_and_fewer_abort() -> None:
    secret = bytes(range(32))
    shares = share_secret(secret, threshold=3, xs=[1, 2, 3, 4, 5])
    assert combine_shares([shares[5], shares[1], shares[3]], threshold=3) == secret
    assert combine_shares(list(shares.values()), threshold=3) == secret
    with pytest.raises(SecAggAbortedError, match="2 distinct shares, 3 needed"):
        combine_shares([shares[2], shares[4], shares[2]], threshold=3)
    # Two shares of a degree-2 polynomial give a wrong secret, never the right one by chance.
    with pytest.raises(ValueError):
        share_secret(secret, threshold=6, xs=[1, 2, 3])


def test_neighbour_graph_is_k_regular_symmetric_and_seeded() -> None:
    ids = [f"c{i}" for i in range(50)]
    k = default_neighbours(50)
    assert k == 12
    graph = neighbours(ids, k=k, seed=b"s")
    assert all(len(near) == k and cid not in near for cid, near in graph.items())
    assert all(a in graph[b] for a in ids for b in graph[a])
    assert graph == neighbours(ids, k=k, seed=b"s")
    assert graph != neighbours(ids, k=k, seed=b"t")
    assert neighbours(ids[:5], k=8, seed=b"s")["c0"] == ["c1", "c2", "c3", "c4"]
    with pytest.raises(ValueError, match="even"):
        neighbours(ids, k=5, seed=b"s")


def test_prg_is_aes256_ctr_of_the_seed() -> None:
    seed = bytes(range(32))
    stream = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update(bytes(8))
    assert prg(seed, 2, bits=32).tolist() == [
        int.from_bytes(stream[:4], "little"),
        int.from_bytes(stream[4:], "little"),
    ]
    assert prg(seed, 8, bits=8).tolist() == list(stream)
    with pytest.raises(ValueError, match="32 bytes"):
        prg(seed[:16], 4, bits=32)


@pytest.mark.parametrize("bits", [8, 16, 32])
def test_weighted_quantized_sum_decodes_to_the_weighted_mean(bits: int) -> None:
    gen = torch.Generator().manual_seed(0)
    xs = [torch.rand(1000, generator=gen, dtype=torch.float64) * 0.8 - 0.4 for _ in range(5)]
    weights = [1.0, 2.0, 3.0, 1.0, 3.0]
    clip, total_w = 0.5, sum(weights)
    scale = ring_scale(bits=bits, clip=clip, clients=len(xs))
    total = torch.zeros(1000, dtype=torch.int64)
    for x, w in zip(xs, weights):
        q, err = quantize(x, weight=w / total_w, clip=clip, scale=scale, bits=bits, generator=gen)
        assert bool((q >= 0).all() and (q < 2**bits).all())
        assert torch.equal(from_wire(to_wire(q, bits=bits), bits=bits), q)
        assert float(err.abs().max()) <= 1 / (w / total_w * scale) + 1e-12
        total = ring_add(total, q, bits=bits)
    mean = sum(w * x for x, w in zip(xs, weights)) / total_w
    got = dequantize(total, scale=scale, bits=bits)
    # Each client's stochastic rounding errs by under one step of the mean.
    assert float((got - mean).abs().max()) <= len(xs) / scale
    if bits == 32:
        assert float((got - mean).abs().max()) < 1e-8


def test_ring_too_narrow_for_the_clients_is_refused() -> None:
    assert ring_scale(bits=8, clip=1.0, clients=100) == 27.0
    with pytest.raises(ValueError, match="8-bit ring cannot hold the sum of 126 clients"):
        ring_scale(bits=8, clip=1.0, clients=126)


@pytest.mark.parametrize("n", [10, 50])
def test_sums_are_exact_with_seeded_dropouts_at_every_step(n: int) -> None:
    k = default_neighbours(n)
    fed = Federation(n, k, k // 2 + 1)
    stages: set[str] = set()
    for trial in range(6):
        gen = torch.Generator().manual_seed(trial)
        inputs = {cid: torch.randint(0, 2**32, (16,), generator=gen) for cid in fed.ids}
        drops = random_drops(fed.ids, 0.1, seed=1000 * n + trial)
        stages.update(stage for stage, gone in drops.items() if gone)
        total, alive = fed.run_round(trial + 1, inputs, drops)
        want = torch.zeros(16, dtype=torch.int64)
        for cid in alive:
            want = ring_add(want, inputs[cid], bits=32)
        assert torch.equal(total, want), f"trial {trial}"
    assert stages == {"advertise", "share", "mask", "unmask"}


def test_below_the_threshold_the_round_aborts_with_no_sum() -> None:
    fed = Federation(10, 8, 5)
    inputs = {cid: torch.arange(4) for cid in fed.ids}
    # Six clients drop after sharing: four masked inputs, threshold 5.
    with pytest.raises(SecAggAbortedError, match="4 masked inputs, fewer than the threshold 5"):
        fed.run_round(1, inputs, {"mask": set(fed.ids[:6])})
    # Enough inputs, but too many holders gone before answering: a secret cannot be rebuilt.
    with pytest.raises(SecAggAbortedError, match="cannot rebuild"):
        fed.run_round(2, inputs, {"unmask": set(fed.ids[:6])})
