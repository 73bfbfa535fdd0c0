"""A small synthetic ``gutenberg-texts.tar.gz`` for tests: a clean clone (CI) has no
``../shared/data/shakespeare``, so tests that read Shakespeare write this one instead."""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

WORDS = "the king and queen shall speak of love and war to thee my lord what news from rome".split()


def synthetic_shakespeare(folder: Path, *, lines_per_speaker: int = 60, seed: int = 0) -> Path:
    """Writes two plays of three speakers each, every speech 12 words of ``WORDS`` drawn with
    ``seed``, into ``folder/gutenberg-texts.tar.gz`` (``folder`` is created); returns ``folder``.

    With the default ``lines_per_speaker`` each role is long enough to have test windows at
    the context lengths the tests use (up to 80 characters)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    with tarfile.open(folder / "gutenberg-texts.tar.gz", "w:gz") as tar:
        for play, speakers in {
            "tempest": ["Pros.", "Mir.", "Ari."],
            "hamlet": ["Ham.", "Hor.", "Oph."],
        }.items():
            lines = [play.upper(), ""]
            for _ in range(lines_per_speaker):
                for speaker in speakers:
                    lines += [speaker, " ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + ".", ""]
            raw = "\n".join(lines).encode("latin-1")
            info = tarfile.TarInfo(f"{play}_gut.txt")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return folder


def tiny_llama(
    folder: Path, *, intermediate_size: int = 64, layers: int = 2, hidden: int = 32, vocab: int = 96
) -> Path:
    """Writes the ``config.json`` of a tiny Llama (vocabulary ``vocab``, 2 heads, context 64) into
    ``folder``, a ``--model hf:PATH`` folder built under a fixed seed on every side; returns ``folder``."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ).save_pretrained(folder)
    return folder
