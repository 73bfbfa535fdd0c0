"""Fixtures the language-model integration tests share: a tiny Llama's ``hf:`` folder and a
synthetic Shakespeare, made once per module."""

from __future__ import annotations

from pathlib import Path

import pytest
from shakespeare_data import synthetic_shakespeare, tiny_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic_shakespeare(tmp_path_factory.mktemp("data") / "shakespeare")
