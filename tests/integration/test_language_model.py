"""The language-model workload end to end in simulation: the GPT learns Shakespeare's characters
below the unigram baseline, metrics.jsonl carries the token loss and its perplexity, and a
Hugging Face causal LM built from a local config folder trains a round (and one from local
weights starts from them).

The data is a small synthetic ``gutenberg-texts.tar.gz`` (``shakespeare_data``): a clean
clone (CI) has no ``../shared/data``. One thread, as the other simulation tests.
"""

from __future__ import annotations

import math

import pytest
import torch
from shakespeare_data import synthetic_shakespeare

from fedgrid.config import load_config
from fedgrid.errors import ConfigError
from fedgrid.runlog import read_metrics
from fedgrid.simulation.language import lm_spec, lm_windows
from fedgrid.simulation.run import run_simulation
from fedgrid.simulation.shakespeare import load_shakespeare
from fedgrid.simulation.tasks import build_model

TINY = "gpt:layers=1,heads=2,dim=32,context=16"


def _unigram_entropy(data_dir) -> float:
    """Nats per character of the training characters' own unigram distribution: the loss of the
    best model that ignores the context."""
    data = lm_windows(load_shakespeare(data_dir, seq_len=16))
    targets = data.text.unfold(0, 16, 1)[data.train_starts + 1].reshape(-1)
    p = torch.bincount(targets, minlength=80).double() / targets.numel()
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def test_gpt_learns_below_the_unigram_baseline_and_logs_perplexity(tmp_path):
    data_dir = synthetic_shakespeare(tmp_path / "data")
    config = load_config(
        overrides={
            "dataset": "shakespeare",
            "data_dir": str(data_dir),
            "model": TINY,
            "clients": 2,
            "rounds": 4,
            "strategy": "diloco",
            "inner_steps": 30,
            "inner_lr": 0.01,
            "threads": 1,
            "progress": False,
            "out": str(tmp_path / "run"),
        }
    )
    _, history = run_simulation(config)
    baseline = _unigram_entropy(data_dir)  # 2.85 nats on these words (ln 80 = 4.38); round 4 reached 1.01
    losses = [m.loss for m in history]
    assert losses[-1] < baseline - 1.0, (losses, baseline)  # it uses the context, not just frequencies
    rows = read_metrics(tmp_path / "run")
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert row["perplexity"] == math.exp(row["loss"])
        assert 0.0 < row["accuracy"] < 1.0  # the token accuracy
    # Weights count windows of 16 tokens, at most those a worker holds: 30 steps of 32 windows
    # cycle through each worker's share, so a round weighs every training window once.
    windows = len(lm_windows(load_shakespeare(data_dir, seq_len=16)).train_starts)
    assert rows[-1]["examples"] == windows


def test_a_hugging_face_causal_lm_from_a_local_config_trains_a_round(tmp_path, monkeypatch):
    from transformers import GPT2Config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "tiny-gpt2"
    GPT2Config(
        n_layer=1, n_head=2, n_embd=32, vocab_size=96, n_positions=64, bos_token_id=0, eos_token_id=0
    ).save_pretrained(folder)
    data_dir = synthetic_shakespeare(tmp_path / "data")
    config = load_config(
        overrides={
            "dataset": "shakespeare",
            "data_dir": str(data_dir),
            "model": f"hf:{folder}",
            "clients": 2,
            "rounds": 1,
            "strategy": "diloco",
            "inner_steps": 5,
            "threads": 1,
            "progress": False,
            "out": str(tmp_path / "run"),
        }
    )
    final, history = run_simulation(config)
    assert final is not None and "net.lm_head.weight" in final
    assert final["net.transformer.wte.weight"].shape == (96, 32)
    (row,) = read_metrics(tmp_path / "run")
    assert row["clients_ok"] == 2 and row["perplexity"] == math.exp(row["loss"])
    assert row["loss"] < math.log(96)  # five steps of two workers already move it off uniform


def test_bf16_clients_train_on_the_sequential_engine_and_batched_refuses_them():
    engines: list[str] = []
    overrides = {"precision": "bf16", "rounds": 1, "threads": 1, "progress": False}
    _, history = run_simulation(
        load_config(overrides=overrides), on_start=lambda engine, why: engines.append(why)
    )
    assert "bf16 autocast (precision bf16)" in engines[0] and history[0].accuracy > 0.3
    with pytest.raises(ConfigError, match="precision fp32 batches it; use --engine sequential") as info:
        run_simulation(load_config(overrides={**overrides, "engine": "batched"}))
    assert info.value.key == "engine"


def test_an_hf_folder_with_weights_starts_from_them(tmp_path, monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(3)
    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=80, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "weights")
    saved = GPT2LMHeadModel.from_pretrained(tmp_path / "weights", local_files_only=True).state_dict()
    built = build_model("shakespeare", f"hf:{tmp_path / 'weights'}").state_dict()
    assert set(built) == {f"net.{k}" for k in saved}
    for key, tensor in saved.items():
        assert torch.equal(built[f"net.{key}"], tensor), key
    assert lm_spec(f"hf:{tmp_path / 'weights'}").context == 32  # its 32 positions, under the 64 of HF_CONTEXT
