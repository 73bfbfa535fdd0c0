"""``fedgrid.client.loaders``: a plain DataLoader read by indexing gives the loader's own
batches and leaves torch's RNGs exactly as iterating the loader does; anything else is named."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset, WeightedRandomSampler

from fedgrid.client.loaders import NotPlainLoader, plain_loader
from fedgrid.client.torch_client import TorchClient
from fedgrid.types import FitIns


def _data(n: int = 53) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 3, 4, generator=g), torch.randint(0, 5, (n,), generator=g))


def _epochs(batches_of, epochs: int) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], torch.Tensor]:
    """``epochs`` passes under seed 7, one dropout-like draw after every batch; the batches, the draws and the RNG state after."""
    torch.manual_seed(7)
    seen, draws = [], []
    for _ in range(epochs):
        for batch in batches_of():
            seen.append(batch)
            draws.append(torch.rand(2))
    return seen, draws, torch.get_rng_state()


def _loaders() -> dict[str, DataLoader]:
    data = _data()
    nested = Subset(Subset(data, list(range(5, 50))), [3, 1, 4, 1, 5, 9, 2, 6, 40, 0, 8])
    return {
        "shuffle": DataLoader(data, batch_size=8, shuffle=True),
        "sequential": DataLoader(data, batch_size=10),
        "drop_last": DataLoader(data, batch_size=8, shuffle=True, drop_last=True),
        "subset of a subset": DataLoader(nested, batch_size=4, shuffle=True),
        "own generator": DataLoader(
            data, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(3)
        ),
        "batch larger than the data": DataLoader(Subset(data, [2, 7]), batch_size=32, shuffle=True),
    }


@pytest.mark.parametrize("name", list(_loaders()))
def test_plain_batches_and_rng_equal_the_loaders(name: str) -> None:
    loader = _loaders()[name]
    plain = plain_loader(loader)
    generator_state = loader.generator.get_state() if loader.generator is not None else None
    expected = _epochs(lambda: iter(loader), 2)
    if generator_state is not None:
        loader.generator.set_state(generator_state)
    got = _epochs(plain.batches, 2)
    assert len(got[0]) == len(expected[0]) > 0
    for (gx, gy), (ex, ey) in zip(got[0], expected[0]):
        assert gx.dtype == ex.dtype and gy.dtype == ey.dtype
        assert torch.equal(gx, ex) and torch.equal(gy, ey)
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))  # draws between batches
    assert torch.equal(got[2], expected[2])  # the global generator ends where the loader leaves it
    if loader.drop_last:
        assert all(len(b[1]) == loader.batch_size for b in got[0])


class _Augmented(TensorDataset):
    def __getitem__(self, index: int):  # type: ignore[override]
        x, y = super().__getitem__(index)
        return x + 1, y


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda d: [(d.tensors[0][:4], d.tensors[1][:4])], "not a torch DataLoader"),
        (lambda d: DataLoader(d, batch_size=4, num_workers=1), "worker processes"),
        (lambda d: DataLoader(d, batch_size=4, collate_fn=lambda b: b), "custom collate_fn"),
        (lambda d: DataLoader(d, batch_size=None), "custom collate_fn or batch sampler"),
        (
            lambda d: DataLoader(d, batch_size=4, sampler=WeightedRandomSampler([1.0] * len(d), 10)),
            "WeightedRandomSampler",
        ),
        (
            lambda d: DataLoader(
                d, batch_size=4, sampler=torch.utils.data.RandomSampler(d, replacement=True)
            ),
            "with replacement",
        ),
        (lambda d: DataLoader(_Augmented(*d.tensors), batch_size=4), "_Augmented, not a TensorDataset"),
        (
            lambda d: DataLoader(TensorDataset(d.tensors[0]), batch_size=4),
            "not a TensorDataset of (inputs, targets)",
        ),
    ],
)
def test_other_loaders_are_named(make, reason: str) -> None:
    with pytest.raises(NotPlainLoader) as err:
        plain_loader(make(_data()))
    assert reason in str(err.value)


class _Wrapped:
    """The same loader behind an iterable that is not a DataLoader: TorchClient iterates it as it is."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader, self.dataset = loader, loader.dataset

    def __iter__(self):
        return iter(self.loader)


def _client(loader) -> TorchClient:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 5))
    return TorchClient(
        model,
        loader,
        nn.functional.cross_entropy,
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        device="cpu",
        seed=4,
        name="c",
    )


def test_torch_client_fit_is_bit_identical_through_the_plain_path() -> None:
    loader = DataLoader(Subset(_data(), list(range(0, 53, 2))), batch_size=5, shuffle=True)
    fast, slow = _client(loader), _client(_Wrapped(loader))
    state = fast._state()
    for round_ in (1, 2):
        ins = FitIns(round=round_, config={"seed": 11, "local_epochs": 2})
        a, b = fast.fit(state, ins), slow.fit(state, ins)
        assert a.num_examples == b.num_examples == 27
        assert a.metrics == b.metrics
        assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
        state = a.state
    assert fast._plain is not None and fast._plain[2] is not None and slow._plain[2] is None


def test_a_new_loader_is_inspected_again() -> None:
    client = _client(DataLoader(_data(), batch_size=5))
    client.fit(client._state(), FitIns(round=1, config={}))
    first = client._plain[2]
    client.train_loader = DataLoader(Subset(_data(), [1, 2, 3]), batch_size=2)
    out = client.fit(client._state(), FitIns(round=1, config={}))
    assert out.num_examples == 3 and client._plain[2] is not first and len(client._plain[2]) == 3


def _conv_client(memory_format: str) -> TorchClient:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 4, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 2 * 2, 5),
    )
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(40, 3, 8, 8, generator=g), torch.randint(0, 5, (40,), generator=g))
    return TorchClient(
        model,
        DataLoader(data, batch_size=8, shuffle=True),
        nn.functional.cross_entropy,
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        eval_loader=DataLoader(data, batch_size=16),
        device="cpu",
        seed=1,
        name="conv",
        memory_format=memory_format,
    )


def test_convolutions_train_channels_last_on_cpu_and_upload_contiguous_state() -> None:
    auto, plain = _conv_client("auto"), _conv_client("contiguous")
    assert (
        auto.channels_last
        and not plain.channels_last
        and not _client(DataLoader(_data(), batch_size=4)).channels_last
    )  # no Conv2d
    state = plain._state()
    ins = FitIns(round=1, config={"seed": 5, "local_epochs": 2})
    a, b = auto.fit(state, ins), plain.fit(state, ins)
    assert (
        auto.model[0].weight.is_contiguous(memory_format=torch.channels_last)
        and not auto.model[0].weight.is_contiguous()
    )
    assert plain.model[0].weight.is_contiguous()
    for name in a.state:
        assert a.state[name].is_contiguous(), name  # what travels is laid out as the wire expects
        torch.testing.assert_close(
            a.state[name], b.state[name], atol=1e-5, rtol=0
        )  # another convolution algorithm, the same training
    assert not torch.equal(a.state["0.weight"], state["0.weight"])
    again = _conv_client("auto").fit(state, ins)
    assert all(
        torch.equal(a.state[n], again.state[n]) for n in a.state
    )  # deterministic: a simulation and a deployment agree
    assert auto.evaluate(a.state, {}).metrics["accuracy"] == pytest.approx(
        plain.evaluate(b.state, {}).metrics["accuracy"]
    )


def test_a_bad_memory_format_is_named() -> None:
    with pytest.raises(
        ValueError, match="memory_format must be one of auto, contiguous, channels_last, got 'nhwc'"
    ):
        _conv_client("nhwc")
