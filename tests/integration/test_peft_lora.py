"""Federated LoRA fine-tuning of a tiny Llama built from a local config (``--model hf:PATH --peft
lora:...``): only the adapters travel (names and bytes), with every uplink codec; a round in
simulation and over gRPC ends bit-identical; a client whose base differs is refused at Join,
both hashes named; the export writes a merged model and a PEFT adapter that load back.

Nothing is downloaded: the model folder is a ``config.json`` the test writes. One thread.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch
from shakespeare_data import tiny_llama

from fedgrid.cli import serve
from fedgrid.client import start_client
from fedgrid.client.uplink import UplinkEncoder
from fedgrid.compression import available_codecs
from fedgrid.compression.spec import CodecSpec
from fedgrid.config import load_config
from fedgrid.errors import BaseModelMismatchError, ConfigError
from fedgrid.runlog import load_model, read_metrics
from fedgrid.simulation.peft_lm import build_peft_lm
from fedgrid.simulation.run import run_simulation
from fedgrid.simulation.tasks import builtin_client, client_options

from harness import THREADS, wait_until

PEFT = "lora:r=4,alpha=8,targets=q_proj,v_proj"
LAYERS, HIDDEN = 2, 32


def _config(llama: Path, data_dir: Path, out: Path, **overrides):
    return load_config(
        overrides={
            "dataset": "shakespeare",
            "data_dir": str(data_dir),
            "model": f"hf:{llama}",
            "peft": PEFT,
            "clients": 2,
            "rounds": 1,
            "local_epochs": 1,
            "optimizer": "adam",
            "lr": 0.01,
            "threads": THREADS,
            "engine": "sequential",
            "progress": False,
            "seed": 3,
            "out": str(out),
            **overrides,
        }
    )


def _adapter_names(ffa: bool = False) -> list[str]:
    prefix = "net.base_model.model.model.layers"
    return [
        f"{prefix}.{i}.self_attn.{proj}.lora_{f}.default.weight"
        for i in range(LAYERS)
        for proj in ("q_proj", "v_proj")
        for f in (("B",) if ffa else ("A", "B"))
    ]


def test_only_the_adapters_travel_and_metrics_show_the_bytes(llama, data_dir, tmp_path):
    final, _ = run_simulation(_config(llama, data_dir, tmp_path / "lora"))
    assert final is not None and list(final) == _adapter_names()
    # r=4 on 32x32 projections: A [4, 32] and B [32, 4], 128 floats each, 8 tensors: 4,096 bytes.
    assert sum(t.numel() * t.element_size() for t in final.values()) == 4096
    (row,) = read_metrics(tmp_path / "lora")
    full, _ = run_simulation(_config(llama, data_dir, tmp_path / "full", peft=""))
    (full_row,) = read_metrics(tmp_path / "full")
    assert full is not None and len(full) == 21  # the whole model: 21 tensors, none of them an adapter
    # Two clients' 4,096 bytes of tensors, with the names and headers of the frames (about 1 KB each).
    assert 2 * 4096 < row["bytes_up"] < 2 * (4096 + 1500), row["bytes_up"]
    assert 2 * 4096 < row["bytes_down"] < 2 * (4096 + 1500), row["bytes_down"]
    assert full_row["bytes_up"] > 20 * row["bytes_up"] and full_row["bytes_down"] > 20 * row["bytes_down"]


#: A spec of each codec family (its parameter, where it takes one).
SPECS = {"qsgd": "qsgd:32", "topk": "topk:0.25", "randk": "randk:0.25", "powersgd": "powersgd:2"}


@pytest.mark.parametrize("codec", available_codecs())
def test_every_uplink_codec_carries_the_adapters_with_error_feedback(llama, data_dir, tmp_path, codec):
    spec = SPECS.get(codec, codec)
    final, history = run_simulation(_config(llama, data_dir, tmp_path / codec, codec=spec, rounds=2))
    assert final is not None and list(final) == _adapter_names()
    assert history[-1].clients_ok == 2 and all(torch.isfinite(t).all() for t in final.values())
    # A client's upload: the adapters' differences alone, and the residuals of those alone.
    model = build_peft_lm(str(llama), PEFT)
    start = model.state_dict()
    trained = {
        n: t + 0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(1))
        for n, t in start.items()
    }
    encoder = UplinkEncoder(CodecSpec.parse(spec))
    encoded, delta = encoder.encode(global_state=start, new_state=trained)
    assert [name for name, *_ in encoded.payloads()] == _adapter_names() and delta == (codec != "none")
    if encoder.feedback is not None:
        assert sorted(encoder.feedback.residuals) == sorted(_adapter_names())


def test_ffa_lora_sends_b_only_and_keeps_a_frozen(llama, data_dir, tmp_path):
    config = _config(llama, data_dir, tmp_path / "ffa", lora_aggregation="ffa")
    final, _ = run_simulation(config)
    assert final is not None and list(final) == _adapter_names(ffa=True)
    model = build_peft_lm(str(llama), PEFT, frozen_a=True)
    assert model.base_hash != build_peft_lm(str(llama), PEFT).base_hash  # the frozen A is part of the base
    assert any(t.abs().sum() > 0 for t in final.values())  # B moved off its zero start


class _Coordinator:
    """``fedgrid coordinator`` (``serve``) in a thread on port 0."""

    def __init__(self, config) -> None:
        self.out = Path(config.out)
        self.result: dict = {}
        self.thread = threading.Thread(
            target=lambda: self.result.setdefault("final", serve(config)), daemon=True
        )
        self.thread.start()
        address = self.out / "address"
        wait_until(
            lambda: address.exists() and address.read_text().strip() != "", timeout=120, what="address"
        )
        self.address = address.read_text().strip()

    def finish(self) -> dict[str, torch.Tensor]:
        self.thread.join(timeout=120)
        assert not self.thread.is_alive(), "the coordinator did not finish"
        return load_model(self.out / "model.safetensors")


def test_a_round_over_grpc_equals_the_simulation_bit_for_bit(llama, data_dir, tmp_path):
    simulated, _ = run_simulation(_config(llama, data_dir, tmp_path / "sim"))
    config = _config(llama, data_dir, tmp_path / "grpc", listen="127.0.0.1:0", min_clients=2)
    run = _Coordinator(config)
    handles = [
        start_client(builtin_client(i, 2, config.seed, client_options(config)), run.address) for i in range(2)
    ]
    deployed = run.finish()
    for handle in handles:
        handle.join(timeout=60)
    assert simulated is not None and list(deployed) == list(simulated) == _adapter_names()
    for name, tensor in simulated.items():
        assert torch.equal(deployed[name], tensor), name
    (row,) = read_metrics(tmp_path / "grpc")
    assert row["clients_ok"] == 2


def test_a_client_with_another_base_is_refused_at_join_naming_both_hashes(llama, data_dir, tmp_path):
    other = tiny_llama(tmp_path / "other-llama", intermediate_size=48)  # another base model
    config = _config(llama, data_dir, tmp_path / "run", listen="127.0.0.1:0", min_clients=1)
    ours = build_peft_lm(str(llama), PEFT).base_hash
    theirs_config = _config(other, data_dir, tmp_path / "unused")
    client = builtin_client(0, 1, config.seed, client_options(theirs_config))
    assert client.base_hash != ours
    run = _Coordinator(config)
    handle = start_client(client, run.address)
    with pytest.raises(Exception) as info:
        handle.join(timeout=60)
    text = str(info.value)
    assert "FAILED_PRECONDITION" in text or isinstance(info.value, BaseModelMismatchError)
    assert ours in text and client.base_hash in text, text
    # A client with the coordinator's base then trains the round.
    good = builtin_client(0, 1, config.seed, client_options(config))
    assert good.base_hash == ours
    handle = start_client(good, run.address)
    assert list(run.finish()) == _adapter_names()
    handle.join(timeout=60)


def test_svd_aggregation_runs_a_federated_round(llama, data_dir, tmp_path):
    final, history = run_simulation(
        _config(llama, data_dir, tmp_path / "svd", lora_aggregation="svd", rounds=2)
    )
    assert final is not None and list(final) == _adapter_names()
    assert history[-1].clients_ok == 2 and history[-1].loss < history[0].loss + 0.5
    for name in _adapter_names():
        if ".lora_A." in name:  # A and B carry the singular values' square roots in equal shares
            b = final[name.replace(".lora_A.", ".lora_B.")]
            torch.testing.assert_close(final[name].norm(dim=1), b.norm(dim=0), rtol=1e-4, atol=1e-6)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft calls a renamed helper
def test_export_writes_a_merged_model_and_a_peft_adapter_with_the_same_logits(
    data_dir, tmp_path, monkeypatch
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from fedgrid.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(5)
    weights = tmp_path / "llama-weights"  # a base with weights, as users fine-tune
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=96,
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=LAYERS,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    ).save_pretrained(weights)
    final, _ = run_simulation(_config(weights, data_dir, tmp_path / "run"))
    assert final is not None and any(t.abs().sum() > 0 for n, t in final.items() if ".lora_B." in n)
    assert main(["export", str(tmp_path / "run"), "--merged", str(tmp_path / "merged")]) == 0
    assert main(["export", str(tmp_path / "run"), "--adapter", str(tmp_path / "adapter")]) == 0
    tokens = torch.randint(0, 80, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = build_peft_lm(str(weights), PEFT)
    ours.load_state_dict(final)
    with torch.no_grad():
        expected = ours.eval()(tokens)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
        base = AutoModelForCausalLM.from_pretrained(weights, local_files_only=True)
        adapter = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        plain = AutoModelForCausalLM.from_pretrained(weights, local_files_only=True).eval()
        torch.testing.assert_close(merged(input_ids=tokens).logits, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(adapter(input_ids=tokens).logits, expected, rtol=0, atol=1e-5)
        assert (plain(input_ids=tokens).logits - expected).abs().max() > 1e-4  # the adapters changed it


def test_export_refuses_a_run_without_adapters(tmp_path, capsys):
    from fedgrid.cli import main

    assert main(["export", str(tmp_path), "--merged", str(tmp_path / "out")]) == 2
    assert "holds no config.toml: not a finished run directory" in capsys.readouterr().err


def test_accumulation_checkpointing_and_bf16_train_a_round(llama, data_dir, tmp_path):
    options = {"grad_accum": 2, "grad_checkpointing": True, "precision": "bf16"}
    final, history = run_simulation(_config(llama, data_dir, tmp_path / "opts", **options))
    assert final is not None and list(final) == _adapter_names()
    assert history[-1].clients_ok == 2 and all(t.dtype == torch.float32 for t in final.values())


def _text_folder(folder: Path, files: int = 3, words: int = 600) -> Path:
    import random

    rng = random.Random(0)
    vocabulary = "the king and queen shall speak of love and war to thee my lord".split()
    folder.mkdir()
    for k in range(files):
        (folder / f"part{k}.txt").write_text(" ".join(rng.choice(vocabulary) for _ in range(words)))
    return folder


def test_text_files_train_a_causal_lm_with_the_byte_tokenizer_one_file_per_client(tmp_path):
    texts = _text_folder(tmp_path / "texts")
    model = tiny_llama(tmp_path / "llama256", vocab=256)
    overrides = {"dataset": "text", "partition": "natural", "clients": 3, "local_epochs": 2, "lr": 0.05}
    final, history = run_simulation(_config(model, texts, tmp_path / "run", **overrides))
    assert final is not None and list(final) == _adapter_names()
    rows = read_metrics(tmp_path / "run")
    # 600 words of about 4.4 bytes: about 41 windows of 64 bytes per file, 90% of them train.
    windows = [((len((texts / f"part{k}.txt").read_bytes()) - 1) // 64) for k in range(3)]
    assert rows[0]["clients_ok"] == 3 and rows[0]["examples"] == sum(int(w * 0.9) for w in windows)
    assert rows[0]["loss"] < math.log(256) and rows[0]["perplexity"] == math.exp(rows[0]["loss"])


def test_text_needs_a_language_model_whose_vocabulary_covers_the_tokenizer(tmp_path):
    texts = _text_folder(tmp_path / "texts", files=1)
    small = tiny_llama(tmp_path / "llama96")
    with pytest.raises(ConfigError, match="vocabulary of 96 tokens is too small: the characters need 256"):
        run_simulation(_config(small, texts, tmp_path / "run", dataset="text", clients=1))
    with pytest.raises(ConfigError, match="dataset text trains a language model"):
        run_simulation(load_config(overrides={"dataset": "text", "data_dir": str(texts), "progress": False}))
