"""The causal-LM client's options: gradient accumulation gives the step of the whole batch, gradient
checkpointing the same gradients as without; the byte-level tokenizer and the token windows."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid.errors import ConfigError
from fedgrid.simulation.causal_lm import (
    AccumulatingClient,
    ByteTokenizer,
    TokenWindows,
    enable_checkpointing,
    load_tokenizer,
    text_tokens,
)
from fedgrid.simulation.language import token_cross_entropy
from fedgrid.types import FitIns


def _client(accum: int) -> AccumulatingClient:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    x = torch.randint(0, 16, (12, 5), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 16, (12, 5), generator=torch.Generator().manual_seed(2))
    client = AccumulatingClient(
        model,
        DataLoader(TensorDataset(x, y), batch_size=12),
        token_cross_entropy,
        lambda params: torch.optim.SGD(params, lr=0.5),
        device="cpu",
    )
    client.grad_accum = accum
    return client


@pytest.mark.parametrize("accum", [2, 3, 5])
def test_accumulated_micro_batches_take_the_step_of_the_whole_batch(accum):
    whole, split = _client(1), _client(accum)
    state = {k: v.clone() for k, v in whole.model.state_dict().items()}
    ins = FitIns(round=1, config={"local_epochs": 1})
    a, b = whole.fit(state, ins), split.fit(state, ins)
    for name, tensor in a.state.items():
        torch.testing.assert_close(b.state[name], tensor, rtol=0, atol=1e-6)
        assert not torch.equal(tensor, state[name])
    assert b.metrics["loss"] == pytest.approx(a.metrics["loss"], abs=1e-6) and b.num_examples == 12


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    from transformers import LlamaConfig

    from fedgrid.simulation.peft_lm import build_peft_lm

    LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ).save_pretrained(tmp_path)
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpoint in (False, True):
        model = build_peft_lm(str(tmp_path), "lora:r=2,alpha=4,targets=q_proj,v_proj")
        with torch.no_grad():  # B off zero, so that A's gradient is not zero either
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.fill_(0.1)
        if checkpoint:
            enable_checkpointing(model)
        model.train()
        token_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert set(grads[0]) == set(grads[1]) and len(grads[0]) == 8
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-6)
        assert grad.abs().sum() > 0


def test_checkpointing_needs_a_hugging_face_model():
    with pytest.raises(ConfigError, match="grad_checkpointing"):
        enable_checkpointing(nn.Linear(2, 2))


def test_bytes_are_the_fallback_tokenizer_and_windows_cover_the_text_once(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("To be, or not to be: that is the question. Ü", encoding="utf-8")
    tokenizer = load_tokenizer(str(tmp_path))  # no tokenizer files there
    assert isinstance(tokenizer, ByteTokenizer)
    ids = text_tokens(str(text), tokenizer)
    assert ids.tolist() == list(text.read_bytes()) and tokenizer.decode(ids.tolist()) == text.read_text()
    windows = TokenWindows(ids, 8)
    assert len(windows) == (len(ids) - 1) // 8
    for i in range(len(windows)):
        x, y = windows[i]
        assert torch.equal(x, ids[8 * i : 8 * i + 8]) and torch.equal(y, ids[8 * i + 1 : 8 * i + 9])
    assert len(TokenWindows(ids, 8, start=2, stop=4)) == 2
    with pytest.raises(ConfigError, match="tokenizer"):
        load_tokenizer(str(tmp_path), spec=str(tmp_path))
    with pytest.raises(ConfigError, match="text_file"):
        text_tokens(str(tmp_path / "missing.txt"), tokenizer)


def test_a_tokenizer_in_the_folder_is_loaded_from_it(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "the", "king", "speaks"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.encode("the king speaks loudly") == [1, 2, 3, 0]
    assert isinstance(load_tokenizer(str(tmp_path), "bytes"), ByteTokenizer)
