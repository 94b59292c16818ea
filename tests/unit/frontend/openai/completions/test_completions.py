"""/v1/completions end to end through aiohttp against the fake engine."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from frontend.engine.stream import OutputStream
from frontend.server import init_app
from frontend.text.output_processor import ChoiceProcessor
from tests.unit.fake_engine import FakeEngine, cached_tokenizer, frontend_config, sse_events

Client = TestClient  # type: ignore[type-arg]
MakeClient = Callable[..., Awaitable[Client]]


@pytest.fixture
def make_client(aiohttp_client: Any, engine: FakeEngine) -> MakeClient:
    async def make(**overrides: Any) -> Client:
        app = init_app(frontend_config(engine, **overrides), cached_tokenizer)
        client: Client = await aiohttp_client(app)
        return client

    return make


@pytest.fixture
async def client(make_client: MakeClient) -> AsyncIterator[Client]:
    yield await make_client()


async def complete(client: Client, **body: Any) -> dict[str, Any]:
    resp = await client.post("/v1/completions", json={"model": "fake-model", **body})
    assert resp.status == 200, await resp.text()
    return dict(await resp.json())


async def stream(client: Client, **body: Any) -> list[Any]:
    """The SSE events of a streamed request: dicts, then the string "[DONE]"."""
    resp = await client.post(
        "/v1/completions", json={"model": "fake-model", "stream": True, **body}
    )
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    return sse_events(await resp.text())


def merge_chunks(events: list[Any]) -> list[dict[str, Any]]:
    """Concatenate streamed choices per index: what the non-streaming answer must equal."""
    merged: dict[int, dict[str, Any]] = {}
    for event in events[:-1]:
        for c in event["choices"]:
            m = merged.setdefault(
                c["index"],
                {
                    "index": c["index"],
                    "text": "",
                    "logprobs": None,
                    "finish_reason": None,
                    "stop_reason": None,
                },
            )
            m["text"] += c["text"]
            if c["logprobs"] is not None:
                lp = m["logprobs"] or {k: [] for k in c["logprobs"]}
                m["logprobs"] = {k: lp[k] + v for k, v in c["logprobs"].items()}
            if c["finish_reason"] is not None:
                m["finish_reason"], m["stop_reason"] = c["finish_reason"], c["stop_reason"]
    return [merged[i] for i in sorted(merged)]


async def test_plain_completion(client: Client) -> None:
    body = await complete(client, prompt="Hello world", max_tokens=4)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    assert choice["text"] == "Hello worldHello world" and choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


CASES = [
    {"prompt": "Hello world", "max_tokens": 5},
    {"prompt": "Hello world", "max_tokens": 5, "logprobs": 2},
    {"prompt": "Hello world", "max_tokens": 3, "echo": True, "logprobs": 1},
    {"prompt": "Hello world", "max_tokens": 0, "echo": True, "logprobs": 3},
    {"prompt": "Hello world", "max_tokens": 0, "echo": True},
    {"prompt": ["Hello world", "a b c"], "max_tokens": 4, "n": 2, "logprobs": 0},
    {"prompt": [[9906, 1917], [64, 65]], "max_tokens": 6, "stop": ["Hello"], "logprobs": 1},
    {"prompt": "Hello world", "max_tokens": 9, "stop": "world", "include_stop_str_in_output": True},
]


# How streamed outputs are grouped: as they come; merged over 2 or 3 engine steps (a stream
# that fell behind); vLLM's --stream-interval 3.
GROUPINGS = [{}, {"merge_steps": 2}, {"merge_steps": 3}, {"stream_interval": 3}]


@pytest.mark.parametrize("grouping", GROUPINGS, ids=["plain", "merge2", "merge3", "interval3"])
@pytest.mark.parametrize("case", CASES)
async def test_stream_equals_non_stream(
    make_client: MakeClient, case: dict[str, Any], grouping: dict[str, int]
) -> None:
    client = await make_client(**grouping)
    whole = await complete(client, **case)
    events = await stream(client, **case)
    assert events[-1] == "[DONE]"
    assert merge_chunks(events) == whole["choices"]
    for event in events[:-1]:
        assert event["usage"] is None
        for c in event["choices"]:
            assert c["text"] or c["finish_reason"] or (c["logprobs"] and c["logprobs"]["tokens"])


async def test_prompt_only_echo_returns_prompt_with_logprobs(client: Client) -> None:
    body = await complete(client, prompt="Hello world", max_tokens=0, echo=True, logprobs=1)
    [choice] = body["choices"]
    assert choice["text"] == "Hello world" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == pytest.approx([None, -0.1, -0.2])
    assert body["usage"]["completion_tokens"] == 0


async def test_batch_and_n_indexing(client: Client, engine: FakeEngine) -> None:
    body = await complete(client, prompt=["Hello world", "a b"], n=2, max_tokens=2, seed=7)
    texts = [c["text"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert texts == ["Hello world"] * 2 + ["a b"] * 2
    assert sorted(a.params.seed or 0 for a in engine.added) == [7, 7, 8, 8]
    assert len({a.request_id for a in engine.added}) == 4
    assert body["usage"] == {"prompt_tokens": 3 + 3, "completion_tokens": 8, "total_tokens": 14}


async def test_include_usage_adds_a_final_chunk(client: Client) -> None:
    body = {"prompt": ["Hello world", "a b"], "n": 2, "max_tokens": 3}
    whole = await complete(client, **body)
    events = await stream(client, stream_options={"include_usage": True}, **body)
    assert events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]
    assert all(e["usage"] is None for e in events[:-2])


async def test_continuous_usage_on_every_chunk(client: Client) -> None:
    events = await stream(
        client, prompt="Hello world", max_tokens=3, stream_options={"continuous_usage_stats": True}
    )
    usages = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert usages == sorted(usages) and usages[-1] == 3


async def test_stop_string_aborts_the_engine_request(client: Client, engine: FakeEngine) -> None:
    body = await complete(client, prompt="Hello world", max_tokens=200, stop="world")
    [choice] = body["choices"]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        "Hello ",
        "stop",
        "world",
    )
    await wait_for(lambda: engine.aborted == [engine.added[0].request_id])


async def test_max_tokens_default_fills_the_context(client: Client, engine: FakeEngine) -> None:
    await complete(client, prompt="Hello world", stop="world")
    assert engine.added[0].params.max_tokens == engine.ready.max_model_len - 3


async def test_stream_disconnect_aborts(make_client: MakeClient, engine: FakeEngine) -> None:
    engine.step_delay = 0.02
    client = await make_client()
    resp = await client.post(
        "/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 200, "stream": True}
    )
    assert (await resp.content.readline()).startswith(b"data: ")
    resp.close()
    await wait_for(lambda: len(engine.aborted) == 2 and not engine.running)


async def test_cancelled_non_stream_request_aborts(client: Client, engine: FakeEngine) -> None:
    engine.step_delay = 0.02
    task = asyncio.create_task(
        client.post("/v1/completions", json={"prompt": "a", "max_tokens": 200})
    )
    await wait_for(lambda: bool(engine.running))
    task.cancel()
    await wait_for(lambda: engine.aborted == [engine.added[0].request_id] and not engine.running)


async def test_engine_error_is_a_400(make_client: MakeClient, engine: FakeEngine) -> None:
    engine.error_prompt_len = 2
    client = await make_client()
    for extra in ({}, {"stream": True}):
        resp = await client.post("/v1/completions", json={"prompt": "Hello world", **extra})
        error = (await resp.json())["error"]
        assert resp.status == 400 and "can never fit" in error["message"]


async def test_dead_engine_gives_503(client: Client, engine: FakeEngine) -> None:
    engine.step_delay = 0.02
    resp = await client.post(
        "/v1/completions", json={"prompt": "a", "max_tokens": 200, "stream": True}
    )
    assert (await resp.content.readline()).startswith(b"data: {")
    loop = asyncio.get_running_loop()
    killed = loop.time()
    engine.stop()
    rest = (await asyncio.wait_for(resp.text(), 2)).strip().split("\n\n")
    assert json.loads(rest[-1][6:])["error"]["code"] == 503  # an error event, then the end
    assert (await client.get("/health")).status == 503
    assert loop.time() - killed < 2
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 503 and (await resp.json())["error"]["type"] == "ServiceUnavailableError"


async def test_health_models_version_and_header(client: Client) -> None:
    resp = await client.get("/health")
    assert resp.status == 200 and ":" in resp.headers["X-Tandem-Frontend"]
    models = await (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert models["data"][0] | {"created": 0} == {
        "id": "fake-model",
        "root": "fake-model",
        "max_model_len": 256,
        "created": 0,
        "owned_by": "tandem",
        "object": "model",
        "parent": None,  # (vLLM's card: a LoRA adapter's base model)
    }
    assert "version" in await (await client.get("/version")).json()


async def test_served_model_name(make_client: MakeClient) -> None:
    client = await make_client(served_model_name="alias")
    assert (
        await client.post(
            "/v1/completions", json={"model": "alias", "prompt": "a", "max_tokens": 1}
        )
    ).status == 200


async def test_api_key(make_client: MakeClient) -> None:
    client = await make_client(api_key="sekrit")
    resp = await client.get("/v1/models")
    assert resp.status == 401 and (await resp.json())["error"]["type"] == "AuthenticationError"
    assert "X-Tandem-Frontend" in resp.headers
    wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status == 401
    ok = await client.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
    assert ok.status == 200 and (await client.get("/health")).status == 200


async def test_openai_client_library(client: Client) -> None:
    """The official client parses our answers (non-stream and stream)."""
    import openai

    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    done = await api.completions.create(
        model="fake-model", prompt="Hello world", max_tokens=2, logprobs=1
    )
    assert done.choices[0].text == "Hello world" and done.choices[0].logprobs is not None
    chunks = [
        c
        async for c in await api.completions.create(
            model="fake-model", prompt="Hello world", max_tokens=2, stream=True
        )
    ]
    assert "".join(c.choices[0].text for c in chunks) == "Hello world"
    await api.close()


async def wait_for(condition: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("with_logprobs", [False, True])
@pytest.mark.parametrize("finish", [(None, None), ("stop", "\n"), ("stop", 7), ("length", None)])
@pytest.mark.parametrize("usage", [None, (3, 4)])
def test_chunk_template_bytes_are_msgspecs_encoding(
    with_logprobs: bool, finish: tuple[str | None, str | int | None], usage: tuple[int, int] | None
) -> None:
    import msgspec

    from frontend.openai.completions.endpoint import ChunkTemplate, to_choice
    from frontend.openai.completions.protocol import CompletionStreamChunk
    from frontend.openai.protocol.base import Usage
    from frontend.text.output_processor import ChoiceDelta

    delta = ChoiceDelta('a "quoted" \\ 你好 🎉\n', tokens=["a", "bytes:\\xe4"],
                        token_logprobs=[None, -0.5], top_logprobs=[None, {"x": -0.5, "y": -2.0}],
                        text_offset=[0, 3], finish_reason=finish[0], stop_reason=finish[1])
    counts = None if usage is None else Usage.of(*usage)
    template = ChunkTemplate("cmpl-\u00e9x", 1700000000, 'm"odel', with_logprobs)
    for index in (0, 3, 0):
        expected = msgspec.json.encode(CompletionStreamChunk(
            "cmpl-\u00e9x", 1700000000, 'm"odel', [to_choice(index, [delta], with_logprobs)],
            counts))
        assert template.chunk(index, delta, counts) == expected


def chunk_tokens(events: list[Any]) -> list[int]:
    """Tokens per streamed chunk (with logprobs, each token has an entry)."""
    return [len(c["logprobs"]["tokens"]) for e in events[:-1] for c in e["choices"]]


async def test_stream_interval_sends_the_first_token_then_every_n(
    make_client: MakeClient,
) -> None:
    client = await make_client(stream_interval=3)
    events = await stream(client, prompt="Hello world", max_tokens=8, logprobs=0)
    assert chunk_tokens(events) == [1, 3, 3, 1]


async def test_merged_steps_make_one_chunk_each(make_client: MakeClient) -> None:
    client = await make_client(merge_steps=2)
    events = await stream(client, prompt="Hello world", max_tokens=9, logprobs=0)
    counts = chunk_tokens(events)
    assert sum(counts) == 9 and all(n >= 2 for n in counts[:-1]), counts


async def test_a_finished_stream_leaves_no_reference_cycle(client: Client) -> None:
    """A streamed request's state (its processors, stream, pump) is freed by reference counting
    when it ends, not left for the garbage collector (whose passes over it cost the frontend)."""
    await stream(client, prompt="Hello world", max_tokens=4, n=2, logprobs=1, echo=True)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        await stream(client, prompt="Hello world", max_tokens=4, n=2, logprobs=1, echo=True)
        await asyncio.sleep(0.05)  # let the handler finish
        gc.collect()
        left = [o for o in gc.garbage if isinstance(o, (OutputStream, ChoiceProcessor))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []
