"""A tiny Llama with weights and a character tokenizer in a local folder (nothing downloaded), and a
small instruction JSONL, for the trainer-callback tests (``fedgrid.integrations``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

#: The instruction pairs the tests' sites fine-tune on (site k takes every other one from k).
PAIRS = [
    ("add 2 and 3", "5"),
    ("add 4 and 1", "5"),
    ("say hello", "hello"),
    ("say bye", "bye"),
    ("spell cat", "c a t"),
    ("spell dog", "d o g"),
    ("repeat ab", "ab ab"),
    ("repeat xy", "xy xy"),
    ("add 1 and 1", "2"),
    ("add 3 and 3", "6"),
    ("say yes", "yes"),
    ("say no", "no"),
]


def char_tokenizer():
    """A ``PreTrainedTokenizerFast`` over the printable ASCII characters (ids 3..97; 0 pad, 1 eos, 2 unk)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({chr(c): 3 + c - 32 for c in range(32, 127)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def tiny_llama_folder(folder: Path, *, seed: int = 0, intermediate_size: int = 64) -> Path:
    """Writes a tiny Llama's weights (drawn under ``seed``) and the character tokenizer to ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def instruction_jsonl(path: Path, pairs: list[tuple[str, str]] = PAIRS) -> Path:
    """``pairs`` as prompt/completion lines of a JSONL file."""
    path.write_text("".join(json.dumps({"prompt": p + " =", "completion": " " + c}) + "\n" for p, c in pairs))
    return path


def token_rows(tokenizer, pairs: list[tuple[str, str]] = PAIRS, length: int = 24) -> list[dict]:
    """``pairs`` as fixed-length causal-LM rows (``input_ids``, ``attention_mask``, ``labels``) for a plain ``Trainer``."""
    rows = []
    for prompt, completion in pairs:
        ids = tokenizer(f"{prompt} = {completion}")["input_ids"][: length - 1] + [tokenizer.eos_token_id]
        pad = length - len(ids)
        rows.append(
            {
                "input_ids": ids + [0] * pad,
                "attention_mask": [1] * len(ids) + [0] * pad,
                "labels": ids + [-100] * pad,
            }
        )
    return rows
