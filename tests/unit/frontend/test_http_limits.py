"""The frontend's event loop against hostile clients (issue 15), on real sockets against the fake
engine: oversized and slow bodies, slowloris headers, readers that stop reading, deep JSON,
undecodable header bytes, large tokenizations, and the truthful overload refusal."""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from aiohttp import ClientConnectionResetError, web
from aiohttp.test_utils import TestClient

from frontend.engine.client import EngineOverloadedError
from frontend.http_limits import MIN_BODY_BYTES, body_limit
from frontend.openai.serving.choices import engine_error
from frontend.openai.serving.sse import SSEWriter
from frontend.options import add_frontend_args, frontend_argv
from frontend.server import parse_args, runner_options
from tests.unit.fake_engine import (
    FakeEngine,
    cached_tokenizer,
    frontend_config,
    production_client,
    tokenizer_folder,
)

Client = TestClient  # type: ignore[type-arg]
LIMIT = 4096  # bytes of body, in these tests
TIMEOUT = 0.5  # seconds, the read and the write timeouts here


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    """A fake engine with room for long streams."""
    fake = FakeEngine(max_model_len=8192).start()
    yield fake
    fake.stop()


@pytest.fixture
def make_client(aiohttp_client: Any, engine: FakeEngine) -> Callable[..., Awaitable[Client]]:
    """A frontend with small limits, served with the production server settings."""

    async def make(**overrides: Any) -> Client:
        limits = {"api_key": "key", "max_request_body_bytes": LIMIT,
                  "http_read_timeout": TIMEOUT, "http_write_timeout": TIMEOUT}
        client: Client = await production_client(
            aiohttp_client, frontend_config(engine, **(limits | overrides)))
        return client

    return make


@pytest.fixture
async def client(make_client: Callable[..., Awaitable[Client]]) -> Client:
    return await make_client()


@pytest.fixture
async def raw(client: Client) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A plain TCP connection to the frontend, to send what no HTTP client would."""
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    yield reader, writer
    writer.close()


def head(path: str, *headers: bytes, length: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1".encode(), b"Host: x", *headers]
    if length is not None:
        lines.append(b"Content-Length: %d" % length)
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What the server sent until it closed the connection; fails if it stays open longer."""
    try:
        return await asyncio.wait_for(reader.read(), seconds)
    except ConnectionResetError:
        return b""


def test_the_body_limit_follows_the_models_context() -> None:
    assert body_limit(2048) == MIN_BODY_BYTES == 2**20
    assert body_limit(131072) == 8 * 2**20
    assert body_limit(131072, configured=1000) == 1000


def test_the_limit_flags_reach_the_frontend_config() -> None:
    flags = ["--max-request-body-bytes", "5000", "--http-read-timeout", "2",
             "--http-write-timeout", "3"]
    parser = argparse.ArgumentParser()
    add_frontend_args(parser)
    passed_on = frontend_argv(parser.parse_args(flags))  # what `tandem serve` gives frontends
    config = parse_args(["--engine", "tcp://127.0.0.1:1", *passed_on])
    assert (config.max_request_body_bytes, config.http_read_timeout,
            config.http_write_timeout) == (5000, 2.0, 3.0)
    assert runner_options(config)["keepalive_timeout"] == 2.0
    defaults = parse_args(["--engine", "tcp://127.0.0.1:1"])
    assert (defaults.max_request_body_bytes, defaults.http_read_timeout,
            defaults.http_write_timeout) == (None, 30.0, 60.0)


async def test_a_declared_body_over_the_limit_is_refused_before_it_is_sent(raw: Any) -> None:
    reader, writer = raw
    writer.write(head("/tokenize", length=60_000_000))  # headers only: the body never comes
    status, _, body = (await asyncio.wait_for(reader.readuntil(b"}}"), 2)).partition(b"\r\n")
    assert status == b"HTTP/1.1 413 Request Entity Too Large"
    assert b'"type":"RequestTooLargeError"' in body and b"4,096 bytes at most" in body


async def test_a_chunked_body_over_the_limit_is_cut_off_at_the_limit(client: Client) -> None:
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal sent
        for _ in range(1000):
            sent += 1024
            yield b'{"prompt": "' + b"a" * 1010 + b'",'
            await asyncio.sleep(0)

    resp = await client.post("/tokenize", data=chunks())
    assert resp.status == 413 and (await resp.json())["error"]["code"] == 413
    assert sent < 100 * 1024  # refused long before the megabyte it would have sent


async def test_a_body_that_trickles_in_is_a_408(raw: Any) -> None:
    reader, writer = raw
    writer.write(head("/tokenize", length=100) + b'{"prompt": ')
    start = time.monotonic()
    answer = await asyncio.wait_for(reader.readuntil(b"}}"), 2 + TIMEOUT)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5 s" in answer
    assert TIMEOUT * 0.9 <= time.monotonic() - start


async def test_headers_sent_a_byte_at_a_time_are_cut_off(raw: Any) -> None:
    reader, writer = raw

    async def trickle() -> None:
        for byte in b"POST /tokenize HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
            writer.write(bytes([byte]))
            await asyncio.sleep(0.02)

    sender = asyncio.create_task(trickle())
    start = time.monotonic()
    try:
        assert await closed_within(reader, TIMEOUT + 2) == b""
    finally:
        sender.cancel()
    assert time.monotonic() - start >= TIMEOUT * 0.9  # the bound, not the first byte, closed it


async def test_deep_json_is_a_400(make_client: Callable[..., Awaitable[Client]]) -> None:
    client = await make_client(max_request_body_bytes=MIN_BODY_BYTES)
    auth = {"Authorization": "Bearer key", "Content-Type": "application/json"}
    depth = 100_000
    for body in (b"[" * depth + b"]" * depth,
                 b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"):
        resp = await client.post("/v1/completions", data=body, headers=auth)
        assert resp.status == 400, await resp.text()
        assert "nested too deeply" in (await resp.json())["error"]["message"]


async def test_undecodable_header_bytes_are_a_401_not_a_500(raw: Any) -> None:
    reader, writer = raw
    body = b'{"prompt": "hi", "max_tokens": 2}'
    writer.write(head("/v1/completions", b"Authorization: Bearer \xff\xfe\xc3(",
                      b"X-Other: \xff", length=len(body)) + body)
    answer = await asyncio.wait_for(reader.readuntil(b"}}"), 2)
    assert answer.startswith(b"HTTP/1.1 401") and b'"code":"invalid_api_key"' in answer


async def test_a_stream_whose_client_stops_reading_is_closed_and_aborted(
    client: Client, engine: FakeEngine
) -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: small window
    sock.connect((client.server.host, client.server.port))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    body = (b'{"prompt": "Hello world", "max_tokens": 8000, "n": 16, "logprobs": 20,'
            b' "stream": true, "ignore_eos": true}')
    writer.write(head("/v1/completions", b"Authorization: Bearer key", length=len(body)) + body)
    start = time.monotonic()
    while len(engine.aborted) < 16:  # the client reads nothing; the socket buffers fill up
        assert time.monotonic() - start < 20, "the stalled stream was never closed"
        await asyncio.sleep(0.05)
    assert not engine.running
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await asyncio.wait_for(reader.readexactly(2**30), 5)  # the rest, then the cut
    writer.close()


async def test_a_write_to_a_connection_the_client_closed_ends_the_stream_quietly(
    client: Client, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture
) -> None:
    """A client gone between two events: its transport is closing, so the direct write is
    not tried and aiohttp's write raises "Cannot write to closing transport" (seen in the
    soak). The stream ends as for a stalled client (its engine requests aborted), and aiohttp
    logs no "Error handling request"."""
    writes = 0
    original, write_now = web.StreamResponse.write, SSEWriter.write_now
    can_write_now = SSEWriter.can_write_now

    async def closing_after_two(self: web.StreamResponse, data: bytes) -> None:
        nonlocal writes
        writes += 1
        if writes > 2:
            raise ClientConnectionResetError("Cannot write to closing transport")
        await original(self, data)

    def counted(self: SSEWriter, payloads: list[bytes]) -> None:
        nonlocal writes
        writes += 1
        write_now(self, payloads)

    monkeypatch.setattr(web.StreamResponse, "write", closing_after_two)
    monkeypatch.setattr(SSEWriter, "write_now", counted)
    monkeypatch.setattr(SSEWriter, "can_write_now", lambda self: writes < 2 and can_write_now(self))
    with caplog.at_level("INFO"):
        resp = await client.post("/v1/completions", headers={"Authorization": "Bearer key"},
                                 json={"prompt": "Hello world", "max_tokens": 500, "n": 2,
                                       "stream": True, "ignore_eos": True})
        assert resp.status == 200
        await resp.read()  # what was written, then the end
        start = time.monotonic()
        while len(engine.aborted) < 2:
            assert time.monotonic() - start < 5, "the gone client's requests were not aborted"
            await asyncio.sleep(0.02)
    assert "the client closed the connection" in caplog.text
    assert "Error handling request" not in caplog.text


async def test_a_large_tokenization_leaves_the_loop_serving(
    make_client: Callable[..., Awaitable[Client]],
) -> None:
    client = await make_client(max_request_body_bytes=MIN_BODY_BYTES)
    text = "the quick brown fox jumps over the lazy dog, 你好 🎉 " * 8_000  # ~450 KB
    tokenize = asyncio.create_task(client.post("/tokenize", json={"prompt": text}))
    answered = 0
    while not tokenize.done():
        resp = await client.get("/health")
        answered += resp.status == 200
        await asyncio.sleep(0.005)
    resp = tokenize.result()
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["tokens"] == cached_tokenizer(tokenizer_folder()).encode(text)
    assert answered >= 10  # while tokenizing (~0.4 s here); 1 or 2 when it held the loop


def test_an_overload_refusal_says_what_is_true() -> None:
    engine_says = "the server is overloaded: 64 requests are already waiting " \
                  "(--max-waiting-requests 64)"
    error = engine_error(EngineOverloadedError(engine_says))
    assert error.status == 503 and error.type == "ServiceUnavailableError"
    assert error.message == ("The server is overloaded: 64 requests are already waiting "
                             "(--max-waiting-requests 64); retry after 1 s.")
