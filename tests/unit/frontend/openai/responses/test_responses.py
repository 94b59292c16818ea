"""/v1/responses through aiohttp against the fake engine (which "generates" the prompt's own
tokens, BOS left out): input items rendered as chat renders the same messages, output items and
their stream events (OpenAI's order, increasing sequence numbers, joined = non-streamed), tool
calls with and without a parser, reasoning items, the store, and the 400s naming the field."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from frontend.server import init_app
from shared.messages import read_ints
from tests.unit.fake_engine import FakeEngine, cached_tokenizer, frontend_config

Client = TestClient  # type: ignore[type-arg]
TOOLS = [{"type": "function", "name": "get_weather", "strict": True,
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
async def client(aiohttp_client: Any, engine: FakeEngine) -> Client:
    config = frontend_config(engine, reasoning_parser="deepseek_r1", responses_store_size=2)
    return await aiohttp_client(init_app(config, cached_tokenizer))


@pytest.fixture
async def hermes(aiohttp_client: Any, engine: FakeEngine) -> Client:
    config = frontend_config(engine, tool_call_parser="hermes")  # no --enable-auto-tool-choice
    return await aiohttp_client(init_app(config, cached_tokenizer))


@pytest.fixture
async def stateless(aiohttp_client: Any, engine: FakeEngine) -> Client:
    return await aiohttp_client(init_app(frontend_config(engine), cached_tokenizer))


async def create(client: Client, status: int = 200, **body: Any) -> dict[str, Any]:
    resp = await client.post("/v1/responses", json=body)
    assert resp.status == status, await resp.text()
    return dict(await resp.json())


async def events_of(client: Client, **body: Any) -> list[dict[str, Any]]:
    """The stream's events, each checked: an `event:` line naming its type, then its data."""
    resp = await client.post("/v1/responses", json={**body, "stream": True})
    assert resp.status == 200, await resp.text()
    events = []
    for block in (await resp.text()).split("\n\n"):
        if block:
            head, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert head == f"event: {event['type']}"
            events.append(event)
    return events


def replay(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The final response, checked against a replay of the events in OpenAI's order."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    items: dict[int, dict[str, Any]] = {}
    done: set[int] = set()
    for e in events[2:-1]:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert e["output_index"] == len(items) and all(i in done for i in items)
            items[e["output_index"]] = dict(e["item"], text="", arguments="")
            continue
        item = items[e["output_index"]]
        assert e["output_index"] not in done
        if kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            item["text"] += e["delta"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert e["text"] == item["text"]
        elif kind == "response.function_call_arguments.delta":
            item["arguments"] += e["delta"]
        elif kind == "response.function_call_arguments.done":
            assert e["arguments"] == item["arguments"] and e["name"] == item["name"]
        elif kind == "response.content_part.done":
            assert e["part"]["text"] == item["text"]
        elif kind == "response.output_item.done":
            final = e["item"]
            if final["type"] == "function_call":
                assert final["arguments"] == item["arguments"]
            else:
                assert [c["text"] for c in final["content"]] == [item["text"]]
            done.add(e["output_index"])
        else:
            assert kind == "response.content_part.added", kind
    assert done == set(items)
    last = events[-1]
    assert last["type"] == f"response.{last['response']['status']}"
    return dict(last["response"])


def comparable(response: dict[str, Any]) -> dict[str, Any]:
    """What a streamed and a non-streamed answer share (ids and times are their own)."""
    def item(i: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in i.items() if k not in ("id", "call_id")}
    return {"status": response["status"], "output": [item(i) for i in response["output"]],
            "usage": response["usage"], "incomplete": response["incomplete_details"]}


async def test_a_string_input_answers_as_chat_does(client: Client, engine: FakeEngine) -> None:
    chat = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi 🎉</think>answer"}], "max_tokens": 30})
    message = (await chat.json())["choices"][0]["message"]
    body = await create(client, input="hi 🎉</think>answer", max_output_tokens=30)
    assert read_ints(engine.added[0].prompt_token_ids) == read_ints(
        engine.added[1].prompt_token_ids)
    assert body["object"] == "response" and body["id"].startswith("resp_")
    reasoning, answer = body["output"]
    assert reasoning["type"] == "reasoning" and answer["type"] == "message"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": message["reasoning"]}]
    assert answer["role"] == "assistant" and answer["content"][0]["type"] == "output_text"
    assert answer["content"][0]["text"] == message["content"]
    assert body["status"] == "incomplete" and answer["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    usage = body["usage"]
    assert usage["output_tokens"] == 30 and usage["total_tokens"] == usage["input_tokens"] + 30
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < 30


@pytest.mark.parametrize("max_output_tokens", [3, 9, 40, 200])
async def test_streamed_events_join_to_the_answer(client: Client,
                                                  max_output_tokens: int) -> None:
    args = dict(input="think 你好</think>and say 🎉", max_output_tokens=max_output_tokens,
                instructions="be brief")
    body = await create(client, **args)
    final = replay(await events_of(client, **args))
    assert comparable(final) == comparable(body)


async def test_engine_failures_before_and_after_the_first_event(stateless: Client,
                                                               engine: FakeEngine) -> None:
    """A refusal before anything was sent is a plain 400; an engine that dies mid-stream ends
    it with a numbered response.failed event (a 503 in its error), and no [DONE]."""
    engine.error_prompt_len = 2
    for stream in (False, True):
        resp = await stateless.post("/v1/responses", json={"input": "Hello world",
                                                           "stream": stream})
        assert resp.status == 400 and "can never fit" in (await resp.json())["error"]["message"]
    engine.error_prompt_len = None
    engine.step_delay = 0.02
    resp = await stateless.post("/v1/responses", json={"input": "a", "max_output_tokens": 200,
                                                       "stream": True})
    assert (await resp.content.readline()) == b"event: response.created\n"
    engine.stop()
    body = "event: response.created\n" + await asyncio.wait_for(resp.text(), 2)
    blocks = body.strip().split("\n\n")
    events = [json.loads(block.split("\n")[1].removeprefix("data: ")) for block in blocks]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert blocks[-1].startswith("event: response.failed\n")
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "503"


async def test_input_items_render_as_their_chat_messages(stateless: Client,
                                                         engine: FakeEngine) -> None:
    """Parts joined, a function call folded into the assistant message before it, its output
    a tool message, a reasoning item given to the next assistant message, instructions first."""
    items = [
        {"role": "developer", "content": "dev"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "calling", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    messages = [
        {"role": "system", "content": "sys"}, {"role": "developer", "content": "dev"},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "calling", "reasoning": "hmm", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    await create(stateless, input=items, instructions="sys", tools=TOOLS, max_output_tokens=2)
    resp = await stateless.post("/v1/chat/completions", json={
        "messages": messages, "tools": [{"type": "function", "function": {
            k: v for k, v in TOOLS[0].items() if k != "type"}}],
        "tool_choice": "none", "max_tokens": 2})
    assert resp.status == 200, await resp.text()
    first, second = (read_ints(a.prompt_token_ids) for a in engine.added)
    assert first == second


async def test_auto_tool_choice_needs_no_server_flags(stateless: Client) -> None:
    body = await create(stateless, input=f"call {CALL}", tools=TOOLS, max_output_tokens=60)
    assert [i["type"] for i in body["output"]] == ["message"]
    assert CALL in body["output"][0]["content"][0]["text"]  # no parser: text


async def test_with_a_tool_call_parser_calls_are_function_call_items(hermes: Client) -> None:
    args = dict(input=f"call {CALL}", tools=TOOLS, max_output_tokens=60)
    body = await create(hermes, **args)
    kinds = [i["type"] for i in body["output"]]
    assert "function_call" in kinds
    call = body["output"][kinds.index("function_call")]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert comparable(replay(await events_of(hermes, **args))) == comparable(body)


async def test_the_store_continues_a_response(client: Client, stateless: Client,
                                              engine: FakeEngine) -> None:
    first = await create(client, input="one", max_output_tokens=3, instructions="ins")
    assert first["store"] is True
    await create(client, input="two", previous_response_id=first["id"], max_output_tokens=3)
    tokenizer = cached_tokenizer(engine.ready.tokenizer)
    prompt = tokenizer.decode(read_ints(engine.added[-1].prompt_token_ids))
    assert "one" in prompt and "two" in prompt and "ins" not in prompt  # instructions: not kept
    unknown = await create(client, 400, input="x", previous_response_id="resp_nope")
    assert unknown["error"]["param"] == "previous_response_id"
    assert "whole conversation" in unknown["error"]["message"]
    for i in range(2):  # the store keeps the last 2: the first is gone
        await create(client, input=f"filler {i}", max_output_tokens=1)
    gone = await create(client, 400, input="x", previous_response_id=first["id"])
    assert gone["error"]["param"] == "previous_response_id"
    refused = await create(stateless, 400, input="x", previous_response_id=first["id"])
    assert "keeps no responses" in refused["error"]["message"]


async def test_a_codex_shaped_request(client: Client) -> None:
    body = {
        "model": "fake-model", "instructions": "You are a coding agent.",
        "input": [{"type": "message", "role": "developer",
                   "content": [{"type": "input_text", "text": "<permissions>...</permissions>"}]},
                  {"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": "fix the bug"}]}],
        "tools": [{"type": "function", "name": "shell", "description": "Runs a command",
                   "strict": False,
                   "parameters": {"type": "object", "additionalProperties": False,
                                  "required": ["command"],
                                  "properties": {"command": {"type": "array",
                                                             "items": {"type": "string"}}}}}],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": False,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0199-abcd",
        "client_metadata": {"x-codex-installation-id": "x"}, "text": {"verbosity": "low"},
        "max_output_tokens": 20,
    }
    done = replay(await events_of(client, **body))
    assert done["status"] == "incomplete" and done["store"] is False
    assert done["reasoning"] == {"effort": "medium", "summary": "auto"}


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input"),
    ({"input": []}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "x", "tool_choice": {"type": "file_search"}, "tools": TOOLS}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "model": "other"}, "model"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "top_k": -5}, "top_k"),  # vLLM's extras: chat's bounds
])
async def test_bad_requests_are_400s_naming_the_field(client: Client, body: dict[str, Any],
                                                      param: str) -> None:
    status = 404 if param == "model" else 400
    error = (await create(client, status, **body))["error"]
    assert error["param"] == param, error
    assert set(error) == {"message", "type", "param", "code"}
