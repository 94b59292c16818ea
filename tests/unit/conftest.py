"""Tokenizer fixtures for the output-processing tests: the real production tokenizers, written
once per session (no model is built)."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from engine_core.default_model import DEFAULT, TINY_QWEN2, TinySpec, write_tokenizer


def _load(spec: TinySpec, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp(f"tokenizer-{spec.name}")
    write_tokenizer(spec, folder)
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="session")
def llama3_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Llama 3 (byte-level BPE, 128k vocab, BOS 128000 added, EOS 128001)."""
    return _load(DEFAULT, tmp_path_factory)


@pytest.fixture(scope="session")
def qwen2_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Qwen2.5 (byte-level BPE, 151k vocab)."""
    return _load(TINY_QWEN2, tmp_path_factory)


@pytest.fixture(scope="session", params=["llama3", "qwen2"])
def byte_bpe_tokenizer(request: pytest.FixtureRequest) -> Any:
    """Each production tokenizer in turn."""
    return request.getfixturevalue(f"{request.param}_tokenizer")
