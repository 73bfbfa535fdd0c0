"""Unit tests of the built-in models and datasets (``fedgrid.simulation.models`` / ``tasks``)."""

from __future__ import annotations

import dataclasses
import gzip
import struct

import numpy as np
import pytest
import torch

from fedgrid.config import load_config
from fedgrid.errors import ConfigError
from fedgrid.simulation import tasks
from fedgrid.simulation.datasets import load_synthetic
from fedgrid.simulation.models import char_lstm, digits_mlp, fmnist_cnn, fmnist_mlp, logistic
from fedgrid.types import FitIns


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "model,inputs,params",
    [
        (digits_mlp(), torch.rand(3, 64), 4_810),
        (fmnist_mlp(), torch.rand(3, 1, 28, 28), 199_210),
        (fmnist_cnn(), torch.rand(3, 1, 28, 28), 1_663_370),
        (logistic(60, 10), torch.rand(3, 60), 610),
        (char_lstm(80), torch.randint(0, 80, (3, 80)), 819_920),
    ],
    ids=["digits_mlp", "fmnist_mlp", "fmnist_cnn", "logistic", "char_lstm"],
)
def test_model_sizes_and_outputs(model, inputs, params):
    assert _params(model) == params
    out = model(inputs)
    assert out.shape == (3, 80 if params == 819_920 else 10)


def test_char_lstm_takes_the_vocabulary_or_its_size():
    assert _params(char_lstm("abc")) == _params(char_lstm(3))
    with pytest.raises(ValueError):
        char_lstm(0)


def test_digits_model_is_unchanged():
    # the first release's digits model: same layers and init order, so results stay bit-identical
    a = tasks.initial_state(digits_mlp, seed=3)
    b = tasks.initial_state(
        lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)), seed=3
    )
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_builtin_client_takes_the_training_options():
    sgd = tasks.builtin_client(
        1,
        4,
        0,
        options=tasks.ClientOptions(batch_size=16, lr=0.2, momentum=0.5, weight_decay=1e-3, device="cpu"),
    )
    opt = sgd.optimizer_factory(sgd.model.parameters())
    assert isinstance(opt, torch.optim.SGD)
    assert (
        opt.defaults["lr"] == 0.2 and opt.defaults["momentum"] == 0.5 and opt.defaults["weight_decay"] == 1e-3
    )
    assert sgd.train_loader.batch_size == 16 and sgd.name == "digits-0001/4"
    for name, cls in (("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)):
        c = tasks.builtin_client(
            0, 4, 0, options=tasks.ClientOptions(optimizer=name, lr=0.01, weight_decay=0.1, device="cpu")
        )
        opt = c.optimizer_factory(c.model.parameters())
        assert type(opt) is cls and opt.defaults["lr"] == 0.01 and opt.defaults["weight_decay"] == 0.1
    logistic_client = tasks.builtin_client(
        0, 4, 0, options=tasks.ClientOptions(model="logistic", device="cpu")
    )
    assert _params(logistic_client.model) == 650


def test_client_options_cover_the_client_keys():
    config = load_config(
        overrides={
            "dataset": "synthetic",
            "batch_size": 8,
            "optimizer": "adam",
            "partition": "iid",
            "weight_decay": 0.01,
        }
    )
    options = tasks.client_options(config)
    assert options == tasks.ClientOptions(
        dataset="synthetic",
        data_dir="",
        partitioner="iid",
        model="",
        batch_size=8,
        optimizer="adam",
        lr=0.1,
        momentum=0.9,
        weight_decay=0.01,
        precision="fp32",
        peft="",
        peft_rank="",
        lora_aggregation=None,
        grad_accum=1,
        grad_checkpointing=False,
    )
    client = tasks.builtin_client(2, 5, 0, dataclasses.replace(options, device="cpu"))
    assert client.name == "synthetic-0002/5" and client.train_loader.batch_size == 8


def test_synthetic_natural_clients_evaluate_on_their_own_devices():
    data = tasks.load_data("synthetic")
    assert data.train_groups is not None and data.test_groups is not None
    client = tasks.builtin_client(3, 10, 0, options=tasks.ClientOptions(dataset="synthetic", device="cpu"))
    x, y = client.train_loader.dataset.tensors
    assert x.shape[1] == 60 and x.dtype == torch.float32 and y.dtype == torch.int64
    ex, _ = client.eval_loader.dataset.tensors
    assert 0 < len(ex) < len(data.y_test)  # its devices' test examples only
    out = client.fit(
        tasks.initial_state(lambda: tasks.build_model("synthetic"), 0),
        FitIns(round=1, config={"local_epochs": 1, "lr": 0.05}),
    )
    assert out.num_examples == len(y)


def test_load_synthetic_is_seeded_and_heterogeneous():
    a, b = (
        load_synthetic(num_devices=6, max_per_device=100),
        load_synthetic(num_devices=6, max_per_device=100),
    )
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    c = load_synthetic(num_devices=6, max_per_device=100, seed=1)
    assert not torch.equal(a.x_train[:10], c.x_train[:10])
    assert a.train_groups is not None and a.test_groups is not None
    assert len(a.y_train) == len(a.train_groups) and len(a.y_test) == len(a.test_groups)
    sizes = np.bincount(a.train_groups) + np.bincount(a.test_groups)
    assert sizes.min() >= 50 and sizes.max() <= 100
    # test fraction 0.2 per device
    assert np.all(np.abs(np.bincount(a.test_groups) - 0.2 * sizes) <= 0.5)


def test_evaluate_in_chunks_equals_one_pass():
    data = tasks.load_data("synthetic")
    assert len(data.y_test) > tasks.EVAL_CHUNK  # several chunks
    state = tasks.initial_state(lambda: tasks.build_model("synthetic"), 1)
    # Every test example (eval_batches bounds it to a subset by default), in several chunks.
    loss, metrics = tasks.make_evaluate("synthetic", eval_batches=len(data.y_test))(state)
    model = tasks.build_model("synthetic")
    model.load_state_dict(state)
    x, y = data.test(slice(None))
    with torch.no_grad():
        out = model(x)
    assert loss == pytest.approx(float(torch.nn.functional.cross_entropy(out, y)), rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(float((out.argmax(1) == y).float().mean()), abs=1e-9)


def _write_idx(path, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + b"".join(
        struct.pack(">I", d) for d in array.shape
    )
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture(scope="module")
def fmnist_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fmnist")
    rng = np.random.default_rng(0)
    _write_idx(root / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (60, 28, 28)))
    _write_idx(root / "train-labels-idx1-ubyte.gz", np.arange(60) % 10)
    _write_idx(root / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (20, 28, 28)))
    _write_idx(root / "t10k-labels-idx1-ubyte.gz", np.arange(20) % 10)
    return str(root)


@pytest.mark.parametrize("model,params", [("", 199_210), ("mlp", 199_210), ("cnn", 1_663_370)])
def test_fashion_mnist_from_data_dir(fmnist_dir, model, params):
    resolved = tasks.resolve(dataset="fashion-mnist", model=model, data_dir=fmnist_dir, seed=0)
    assert sum(t.numel() for t in resolved.initial_state.values()) == params
    assert resolved.evaluate is not None
    loss, metrics = resolved.evaluate(resolved.initial_state)
    assert 1.5 < loss < 3.5 and 0.0 <= metrics["accuracy"] <= 1.0
    client = resolved.client_factory(
        0,
        3,
        0,
        options=tasks.ClientOptions(
            dataset="fashion-mnist", data_dir=fmnist_dir, model=model, partitioner="shards:2", device="cpu"
        ),
    )
    x, y = client.train_loader.dataset.tensors
    assert x.shape[1:] == (1, 28, 28) and float(x.max()) <= 1.0
    assert len(torch.unique(y)) <= 4 and len(y) == 20


@pytest.mark.parametrize(
    "options,key,words",
    [
        ({"dataset": "imagenet"}, "dataset", "unknown dataset 'imagenet'"),
        ({"dataset": "fashion-mnist"}, "data_dir", "reads its files from --data-dir"),
        ({"dataset": "digits", "data_dir": "/no/such/folder"}, "data_dir", "is not a folder"),
        (
            {"dataset": "digits", "model": "cnn"},
            "model",
            "unknown model 'cnn' for dataset digits \\(known: mlp, logistic; or MODULE:FACTORY\\)",
        ),
        ({"dataset": "digits", "model": "pkg:"}, "model", "expected MODULE:ATTRIBUTE"),
        (
            {"dataset": "digits", "partition": "natural"},
            "partition",
            "natural needs a dataset with natural groups \\(shakespeare, text, synthetic\\); digits has none",
        ),
        ({"dataset": "digits", "partition": "shards:0"}, "partition", "at least 1"),
        (
            {"dataset": "digits", "optimizer": "lbfgs"},
            "optimizer",
            "unknown optimizer 'lbfgs' \\(known: sgd, adam, adamw\\)",
        ),
        ({"dataset": "digits", "batch_size": 0}, "batch_size", "must be at least 1"),
        ({"dataset": "digits", "engine": "gpu"}, "engine", "unknown engine 'gpu'"),
        ({"dataset": "digits", "batch_clients": -1}, "batch_clients", "must be at least 0"),
        ({"dataset": "digits", "momentum": -0.5}, "momentum", "at least 0"),
        ({"partition": "foo"}, "partition", "unknown partitioner 'foo'"),
        ({"partition": "dirichlet:abc"}, "partition", "dirichlet needs a number"),
        ({"partition": "dirichlet:0"}, "partition", "alpha must be positive"),
        (
            {"dataset": "nope"},
            "dataset",
            "unknown dataset 'nope' \\(known: digits, fashion-mnist, shakespeare, synthetic, text\\)",
        ),
    ],
)
def test_bad_options_fail_in_config_naming_the_key(options, key, words):
    with pytest.raises(ConfigError, match=words) as info:
        tasks.check_config(load_config(overrides=options))
    assert info.value.key == key


def test_custom_model_drops_server_evaluation():
    resolved = tasks.resolve(dataset="digits", model="torch.nn:Identity")
    assert resolved.evaluate is None and dict(resolved.initial_state) == {}
    assert tasks.resolve(dataset="digits", model="logistic").evaluate is not None
