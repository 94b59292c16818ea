"""The engine tests' shared fixtures: the tiny Llama's tokenizer and its Hugging Face
reference (test_hf_parity.Reference), one of each per test module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.engine.test_hf_parity import Reference


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_llama))


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> Reference:
    return Reference(tiny_llama)
