"""The language-model workload's parts: the GPT and its size strings, ``hf:`` folders checked
before anything is built, next-character windows, the token loss, and the precision option."""

from __future__ import annotations

import json
import math

import pytest
import torch
from shakespeare_data import synthetic_shakespeare
from torch.utils.data import DataLoader, TensorDataset

from fedgrid.client.precision import autocast_dtype
from fedgrid.client.torch_client import TorchClient
from fedgrid.config import load_config
from fedgrid.errors import ConfigError
from fedgrid.plugins import initial_state, is_factory_spec
from fedgrid.simulation.language import (
    GPT,
    GPT_DEFAULT,
    GPTSize,
    LMSpec,
    check_lm,
    lm_spec,
    lm_windows,
    next_char_windows,
    parse_gpt,
    token_cross_entropy,
)
from fedgrid.simulation.shakespeare import load_shakespeare
from fedgrid.simulation.tasks import ClientOptions, build_model, builtin_client, check_options, make_evaluate


def test_gpt_sizes_parse_with_defaults_for_the_rest():
    assert parse_gpt("gpt") == GPT_DEFAULT == GPTSize(layers=2, heads=4, dim=64, context=64, tie=False)
    assert parse_gpt("gpt:layers=3,heads=2,dim=32,context=16,tie=1") == GPTSize(3, 2, 32, 16, True)
    assert parse_gpt("gpt:dim=32") == GPTSize(dim=32)
    assert sum(p.numel() for p in GPT(80).parameters()) == 114_432


@pytest.mark.parametrize(
    "spec, words",
    [
        ("gpt:heads=3,dim=64", r"heads \(3\) must divide dim \(64\)"),
        ("gpt:layers=0", "layers must be at least 1, got 0"),
        ("gpt:context=-4", "context must be at least 1"),
        ("gpt:width=64", "KEY one of layers, heads, dim, context, tie, got 'width=64'"),
        ("gpt:layers", "expected KEY=VALUE"),
        ("gpt:dim=big", "dim must be a whole number, got 'big'"),
        ("gpt:tie=2", "tie must be 0 or 1"),
    ],
)
def test_bad_gpt_sizes_name_the_model_key(spec, words):
    with pytest.raises(ConfigError, match=words) as info:
        lm_spec(spec)
    assert info.value.key == "model"


def test_gpt_is_causal_and_maps_tokens_to_logits_at_every_position():
    torch.manual_seed(0)
    net = GPT(80, GPTSize(layers=1, heads=2, dim=16, context=8)).eval()
    x = torch.randint(0, 80, (3, 8))
    out = net(x)
    assert out.shape == (3, 8, 80)
    changed = x.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % 80
    later = net(changed)
    torch.testing.assert_close(later[:, :5], out[:, :5])  # no position sees a later one
    assert not torch.allclose(later[:, 5:], out[:, 5:])
    assert net(x[:, :4]).shape == (3, 4, 80)
    with pytest.raises(ValueError, match="9 tokens do not fit a context of 8"):
        net(torch.zeros(1, 9, dtype=torch.int64))


def test_tied_head_shares_the_token_embedding():
    net = GPT(80, parse_gpt("gpt:dim=16,heads=2,tie=1"))
    assert net.head.weight is net.tok.weight
    assert "head.weight" not in dict(net.named_parameters())  # one parameter, trained once


def test_model_key_schemes_are_not_user_factories():
    assert not is_factory_spec("gpt:layers=2") and not is_factory_spec("hf:/models/tiny")
    assert not is_factory_spec("gpt") and is_factory_spec("mymodels:make")


def test_hf_folders_are_checked_before_transformers_is_imported(tmp_path):
    with pytest.raises(ConfigError, match="no such folder") as info:
        check_lm(LMSpec("hf", path=str(tmp_path / "absent")))
    assert info.value.key == "model"
    with pytest.raises(ConfigError, match="no config.json in the folder") as info:
        check_lm(LMSpec("hf", path=str(tmp_path)))
    assert info.value.key == "model"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50}))
    with pytest.raises(ConfigError, match="vocabulary of 50 tokens is too small: the characters need 80"):
        build_model("shakespeare", f"hf:{tmp_path}")
    with pytest.raises(ConfigError, match="needs the folder"):
        lm_spec("hf:")


def test_language_models_need_shakespeare_and_are_listed(tmp_path):
    with pytest.raises(ConfigError, match="add --dataset shakespeare") as info:
        check_options(dataset="digits", model="gpt")
    assert info.value.key == "model"
    with pytest.raises(ConfigError, match=r"known: lstm, gpt\[:SIZES\], hf:PATH"):
        check_options(dataset="shakespeare", data_dir=str(tmp_path), model="transformer")
    with pytest.raises(ConfigError, match="unknown precision 'fp16'") as info:
        load_config(overrides={"precision": "fp16"})
    assert info.value.key == "precision"


def test_windows_do_not_overlap_and_their_targets_are_the_next_characters(tmp_path):
    data_dir = synthetic_shakespeare(tmp_path / "data")
    full = load_shakespeare(data_dir, seq_len=16)
    data = lm_windows(full)
    assert 0 < len(data.train_starts) <= len(full.train_starts) // 16 + len(full.roles)
    for split in ("train", "test"):
        starts = data.train_starts if split == "train" else data.test_starts
        roles = data.train_roles if split == "train" else data.test_roles
        same_role = torch.from_numpy(roles[1:] == roles[:-1])
        assert bool((starts[1:] - starts[:-1])[same_role].eq(16).all())  # back to back, no overlap
        x, y = next_char_windows(data, split, torch.arange(len(starts)))
        assert x.shape == y.shape == (len(starts), 16)
        assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y[:, -1], data.text[starts + 16])


def test_token_cross_entropy_is_the_mean_over_every_position():
    torch.manual_seed(1)
    logits, targets = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    by_hand = -torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).mean()
    torch.testing.assert_close(token_cross_entropy(logits, targets), by_hand)
    torch.testing.assert_close(token_cross_entropy(logits, targets, reduction="sum"), by_hand * 6)


class _Echo(torch.nn.Module):
    """Logits that put all mass on the input token: the next-token guess "same as this one"."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(10.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(x, 4).float() * self.scale


def test_client_evaluate_reports_token_accuracy_for_sequence_outputs():
    x = torch.tensor([[0, 1, 2, 3], [1, 1, 1, 1]])
    y = torch.tensor([[0, 1, 0, 0], [1, 1, 1, 2]])  # 5 of 8 tokens equal their input
    loader = DataLoader(TensorDataset(x, y), batch_size=1)
    client = TorchClient(
        _Echo(), loader, token_cross_entropy, torch.optim.SGD, eval_loader=loader, device="cpu"
    )
    out = client.evaluate(client.model.state_dict(), {})
    assert out.num_examples == 2 and out.metrics["accuracy"] == 5 / 8
    with torch.no_grad():  # equal-length windows: the per-window means average to the token mean
        expected = float(token_cross_entropy(_Echo()(x), y))
    assert out.metrics["loss"] == pytest.approx(expected, rel=1e-6)


def test_precision_auto_is_fp32_on_the_cpu_and_bf16_autocasts_there_when_asked(tmp_path):
    cpu = torch.device("cpu")
    assert autocast_dtype(cpu, "auto") is None and autocast_dtype(cpu, "fp32") is None
    assert autocast_dtype(cpu, "bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="precision must be one of auto, bf16, fp32"):
        autocast_dtype(cpu, "half")
    data_dir = str(synthetic_shakespeare(tmp_path / "data"))
    model = "gpt:layers=1,heads=2,dim=16,context=16"
    client = builtin_client(
        0,
        2,
        0,
        options=ClientOptions(dataset="shakespeare", data_dir=data_dir, model=model, precision="bf16"),
    )
    seen: list[torch.dtype] = []
    client.model.head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    loss, _ = client._batch_loss(client.model, *next(iter(client.train_loader)))
    assert seen == [torch.bfloat16] and loss.dtype == torch.float32 and math.isfinite(float(loss.detach()))
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in client.model.parameters())


def test_server_evaluation_reports_perplexity_and_runs_at_the_precision_asked(tmp_path):
    data_dir = str(synthetic_shakespeare(tmp_path / "data"))
    model = "gpt:layers=1,heads=2,dim=16,context=16"
    state = initial_state(lambda: build_model("shakespeare", model), seed=0)
    fp32_loss, fp32 = make_evaluate("shakespeare", model, data_dir, "fp32")(state)
    bf16_loss, bf16 = make_evaluate("shakespeare", model, data_dir, "bf16")(state)
    assert fp32["perplexity"] == math.exp(fp32_loss) and bf16["perplexity"] == math.exp(bf16_loss)
    assert abs(fp32_loss - math.log(80)) < 0.1  # an untrained model guesses about uniformly
    assert bf16_loss != fp32_loss and bf16_loss == pytest.approx(fp32_loss, abs=0.02)  # autocast ran
