"""Session fixtures shared by every test package: the tiny models, built once per run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine_core.worker.default_model import DEFAULT, TINY_QWEN2, TINY_QWEN3, ensure_model


def _cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("TANDEM_TEST_CACHE")
    return Path(configured) if configured else tmp_path_factory.getbasetemp() / "models"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model(DEFAULT, _cache(tmp_path_factory))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model(TINY_QWEN2, _cache(tmp_path_factory))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model(TINY_QWEN3, _cache(tmp_path_factory))
