"""Frontend unit-test fixtures: the real production tokenizers (written once per session, no
model is built, loaded as the frontend loads them), and a fake engine with a frontend app client
for the HTTP-layer tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine_core.worker.default_model import DEFAULT, TINY_QWEN2, TinySpec, write_tokenizer
from frontend.server import init_app
from frontend.text.tokenizer_loader import load_tokenizer
from tests.unit.fake_engine import FakeEngine, cached_tokenizer, frontend_config


def _load(spec: TinySpec, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp(f"tokenizer-{spec.name}")
    write_tokenizer(spec, folder)
    return load_tokenizer(str(folder))


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


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    """A fake engine on a real ZeroMQ socket (a test may stop it early to play a dead engine)."""
    fake = FakeEngine().start()
    yield fake
    if fake._thread.is_alive():
        fake.stop()


@pytest.fixture
async def client(aiohttp_client: Any, engine: FakeEngine) -> Any:
    """An aiohttp test client of the frontend app, talking to the fake engine."""
    return await aiohttp_client(init_app(frontend_config(engine), cached_tokenizer))
