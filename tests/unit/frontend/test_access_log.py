"""The access log: one line per HTTP request with the fields of aiohttp's default line, from the
server settings production uses; none with --disable-uvicorn-access-log."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.unit.fake_engine import FakeEngine, frontend_config, production_client


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    fake = FakeEngine().start()
    yield fake
    fake.stop()


Client = TestClient  # type: ignore[type-arg]


async def served(aiohttp_client: Any, engine: FakeEngine, access_log: bool) -> Client:
    client: Client = await production_client(
        aiohttp_client, frontend_config(engine, access_log=access_log))
    return client


async def test_one_line_per_request(aiohttp_client: Any, engine: FakeEngine,
                                    caplog: pytest.LogCaptureFixture) -> None:
    client = await served(aiohttp_client, engine, access_log=True)
    with caplog.at_level(logging.INFO, logger="aiohttp.access"):
        resp = await client.post("/v1/completions?x=1", headers={"User-Agent": "probe/1",
                                                                 "Referer": "http://r/"},
                                 json={"model": "fake-model", "prompt": "Hi", "max_tokens": 2})
        body = await resp.read()
        assert resp.status == 200
        resp = await client.get("/v1/nope")
        assert resp.status == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert len(lines) == 2, lines
    ok, missing = lines
    assert ok.startswith("127.0.0.1 \"POST /v1/completions?x=1 HTTP/1.1\" 200 ")
    assert ok.endswith(' "http://r/" "probe/1"')
    sent, took = ok.split()[5:7]
    assert int(sent) > len(body)  # bytes written, headers included (aiohttp's %b)
    assert took.endswith("s") and float(took.removesuffix("s")) >= 0  # the time taken
    assert '"GET /v1/nope HTTP/1.1" 404 ' in missing and ' "-" "Python/' in missing


async def test_no_lines_when_disabled(aiohttp_client: Any, engine: FakeEngine,
                                      caplog: pytest.LogCaptureFixture) -> None:
    client = await served(aiohttp_client, engine, access_log=False)
    with caplog.at_level(logging.INFO, logger="aiohttp.access"):
        assert (await client.get("/v1/models")).status == 200
    assert not [r for r in caplog.records if r.name == "aiohttp.access"]
