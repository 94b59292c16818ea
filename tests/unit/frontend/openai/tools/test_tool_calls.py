"""Tool calling on /v1/chat/completions against the fake engine, which "generates" the rendered
prompt's own tokens (BOS left out). The default template writes the system message right after
BOS, so a system message is what the "model" answers first; an EOS written into it ends the
answer with finish "stop"."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from frontend.openai.protocol.structured import MAX_SCHEMA_DEPTH, SCHEMA_LIMITS, schema_width
from frontend.openai.tools.calls import TOOL_GRAMMAR_LIMITS, FunctionDefinition, required_schema
from frontend.server import init_app
from shared.messages import StructuredOutput, read_ints
from tests.unit.fake_engine import (
    FakeEngine,
    cached_tokenizer,
    frontend_config,
    sse_events,
    tokenizer_folder,
)

Client = TestClient  # type: ignore[type-arg]
EOS_TEXT = "<｜end▁of▁sentence｜>"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "noop"}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def deep_tool(depth: int) -> dict[str, Any]:
    """A tool whose parameters nest `depth` JSON objects and arrays deep."""
    items: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 3):
        items = {"type": "array", "items": items}
    parameters = {"type": "object", "properties": {"x": items}}
    return {"type": "function", "function": {"name": "deep", "parameters": parameters}}


TOO_DEEP = [*TOOLS, deep_tool(MAX_SCHEMA_DEPTH + 1)]


def enum_tool(name: str, values: int) -> dict[str, Any]:
    """A tool whose one parameter is an enum of `values` strings."""
    parameters = {"type": "object", "required": ["v"],
                  "properties": {"v": {"enum": [f"{i:03d}" for i in range(values)]}}}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def realistic_tool(i: int) -> dict[str, Any]:
    """A tool as APIs describe theirs: 8 parameters (3 optional), one an enum of 6 values."""
    props: dict[str, Any] = {f"param_{i}_{j}": {"type": "string"} for j in range(7)}
    props[f"unit_{i}"] = {"type": "string", "enum": [f"choice_{k}" for k in range(6)]}
    parameters = {"type": "object", "properties": props, "required": list(props)[:5]}
    return {"type": "function", "function": {"name": f"tool_number_{i}",
                                             "description": "Does a thing. " * 10,
                                             "parameters": parameters}}


# Each tool within SCHEMA_LIMITS, together over TOOL_GRAMMAR_LIMITS' enum values.
TOO_WIDE_TOGETHER = [enum_tool(f"t{i}", SCHEMA_LIMITS.enum_values) for i in range(3)]
PATTERN_TOOL = {"type": "function", "function": {"name": "code", "parameters": {
    "type": "object", "properties": {"c": {"type": "string", "pattern": "[A-Z]+",
                                           "minLength": 2}}}}}
DEEP_CHOICE = {"type": "function", "function": {"name": "deep"}}


def sorted_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def answering(text: str) -> list[dict[str, Any]]:
    """Messages the fake engine answers with `text` (then EOS)."""
    return [{"role": "system", "content": text + EOS_TEXT}, {"role": "user", "content": "Hi"}]


async def post(client: Client, status: int = 200, **body: Any) -> Any:
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == status, await resp.text()
    if body.get("stream") and status == 200:
        return sse_events(await resp.text())
    return await resp.json()


def join_stream(events: list[Any]) -> dict[str, Any]:
    """A streamed choice folded into the non-streamed message shape; checks OpenAI's order
    (role first, then each call's id/type/name with arguments "", then argument fragments)."""
    content: str | None = None
    calls: list[dict[str, Any]] = []
    finish = None
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for event in events[1:-1]:
        (choice,) = event["choices"]
        delta = choice["delta"]
        assert finish is None
        if "content" in delta:
            content = (content or "") + delta["content"]
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(calls) and call["type"] == "function"
                assert call["function"]["arguments"] == ""
                calls.append({"id": call["id"], "type": "function",
                              "function": {"name": call["function"]["name"], "arguments": ""}})
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {
                    "arguments"}
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        finish = choice["finish_reason"]
    message: dict[str, Any] = {"content": content, "role": "assistant"}
    if calls:
        message["tool_calls"] = calls
    return {"message": message, "finish_reason": finish}


def without_ids(choice: dict[str, Any]) -> dict[str, Any]:
    message = dict(choice["message"])
    for call in message.get("tool_calls", []):
        assert call["id"].startswith("call_")
    message["tool_calls"] = [{**c, "id": None} for c in message.get("tool_calls", [])]
    return {"message": message, "finish_reason": choice["finish_reason"]}


async def both(client: Client, **body: Any) -> dict[str, Any]:
    """The non-streamed choice, checked equal (ids aside) to the joined streamed one."""
    whole = (await post(client, **body))["choices"][0]
    streamed = join_stream(await post(client, stream=True, **body))
    assert without_ids(streamed) == without_ids(whole)
    return {"message": whole["message"], "finish_reason": whole["finish_reason"]}


# Each parser, streamed as outputs come and merged over 3 engine steps.
@pytest.fixture(params=[("hermes", 1), ("llama3_json", 1), ("hermes", 3), ("llama3_json", 3)],
                ids=["hermes", "llama3_json", "hermes-merge3", "llama3_json-merge3"])
async def auto_client(aiohttp_client: Any, engine: FakeEngine,
                      request: pytest.FixtureRequest) -> Any:
    parser, merge_steps = request.param
    config = frontend_config(engine, enable_auto_tool_choice=True, tool_call_parser=parser,
                             merge_steps=merge_steps)
    client = await aiohttp_client(init_app(config, cached_tokenizer))
    client.parser = parser
    return client


async def test_named_choice_sends_the_parameters_schema(client: Client,
                                                        engine: FakeEngine) -> None:
    args = '{"city": "Paris"}'
    choice = await both(client, messages=answering(args), tools=TOOLS, tool_choice=NAMED)
    assert engine.added[-1].params.structured == StructuredOutput("json", sorted_json(WEATHER))
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": args}
    assert choice["message"]["content"] is None
    assert choice["finish_reason"] == "stop"  # as vLLM answers a named tool_choice


@pytest.mark.parametrize("parallel", [True, False])
async def test_required_choice_sends_an_array_of_calls(client: Client, engine: FakeEngine,
                                                       parallel: bool) -> None:
    text = ('[{"name": "get_weather", "parameters": {"city": "Par\\"is"}},\n'
            ' {"name": "noop", "parameters": {}}]')
    choice = await both(client, messages=answering(text), tools=TOOLS,
                        tool_choice="required", parallel_tool_calls=parallel)
    structured = engine.added[-1].params.structured
    assert structured is not None
    schema = json.loads(structured.spec)
    assert schema.get("maxItems") == (None if parallel else 1) and schema["minItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["noop"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER
    calls = [c["function"] for c in choice["message"]["tool_calls"]]
    expected = [{"name": "get_weather", "arguments": '{"city": "Par\\"is"}'},
                {"name": "noop", "arguments": "{}"}]
    assert calls == (expected if parallel else expected[:1])  # the grammar allows one only
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"


async def test_required_cut_by_max_tokens_keeps_length(client: Client) -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    choice = await both(client, messages=answering(text), tools=TOOLS, tool_choice="required",
                        max_tokens=12)
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert '{"city": "Paris"}'.startswith(call["function"]["arguments"])
    assert choice["finish_reason"] == "length"


def test_required_schema_hoists_defs() -> None:
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
              "$defs": {"P": {"type": "integer"}}}
    schema = required_schema([FunctionDefinition(name="f", parameters=params)], True)
    assert schema["$defs"] == {"P": {"type": "integer"}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]


AUTO_CALLS = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris"}}\n</tool_call>\n<tool_call>{"name": "noop", "arguments": {}}'
               "</tool_call>", "Let me check."),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "noop", "parameters": {}}', None),
}


@pytest.mark.parametrize("parallel", [True, False])
async def test_auto_parses_the_models_calls(auto_client: Any, engine: FakeEngine,
                                            parallel: bool) -> None:
    text, content = AUTO_CALLS[auto_client.parser]
    choice = await both(auto_client, messages=answering(text), tools=TOOLS,
                        parallel_tool_calls=parallel)
    assert engine.added[-1].params.structured is None  # generation is free
    calls = [c["function"] for c in choice["message"]["tool_calls"]]
    expected = [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                {"name": "noop", "arguments": "{}"}]
    assert calls == (expected if parallel else expected[:1])
    assert choice["message"]["content"] == content
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("text", ["Just words, no <tool_ call> here {}", '{"name": 3}',
                                  '<tool_call>{"bad json</tool_call> tail'])
async def test_auto_without_a_call_is_content(auto_client: Any, text: str) -> None:
    choice = await both(auto_client, messages=answering(text), tools=TOOLS, tool_choice="auto")
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == text
    assert choice["finish_reason"] == "stop"


async def test_tool_choice_none_answers_as_before(client: Client, engine: FakeEngine) -> None:
    text = '<tool_call>{"name": "noop", "arguments": {}}</tool_call>'
    body = await post(client, messages=answering(text), tools=TOOLS, tool_choice="none",
                      max_tokens=3)
    message = body["choices"][0]["message"]
    assert set(message) == {"role", "content"} and text.startswith(message["content"])
    assert engine.added[-1].params.structured is None


async def test_round_trip_renders_calls_and_results(client: Client, engine: FakeEngine) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    body = await post(client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert body["choices"][0]["finish_reason"] == "length"
    tokenizer = cached_tokenizer(tokenizer_folder())
    as_template = [messages[0], {**messages[1], "content": ""}, messages[2]]
    as_template[1]["tool_calls"] = [{**messages[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]
    text = tokenizer.apply_chat_template(as_template, tools=TOOLS, add_generation_prompt=True,
                                         tokenize=False)
    assert read_ints(engine.added[-1].prompt_token_ids) == tokenizer.encode(
        text, add_special_tokens=False)
    assert "<｜tool▁output▁begin｜>{\"temp\": 21}" in text


BAD = [
    ({"tools": TOOLS}, "tool_choice"),  # "auto" by default, not enabled on this server
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": TOOLS[:1] + [deep_tool(MAX_SCHEMA_DEPTH + 1)], "tool_choice": "required"},
     "tools"),
    ({"tools": TOO_DEEP, "tool_choice": DEEP_CHOICE}, "tools"),
    ({"tools": [enum_tool("wide", SCHEMA_LIMITS.enum_values + 1)], "tool_choice": "required"},
     "tools"),
    ({"tools": TOO_WIDE_TOGETHER, "tool_choice": "required"}, "tools"),
    ({"tools": [PATTERN_TOOL], "tool_choice": "required"}, "tools"),
    ({"tools": [PATTERN_TOOL], "tool_choice": {"type": "function", "function": {"name": "code"}}},
     "tools"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
async def test_bad_tool_fields_are_400s(client: Client, fields: dict[str, Any],
                                        param: str) -> None:
    for stream in (False, True):
        body = await post(client, 400, messages=answering("x"), stream=stream, **fields)
        assert body["error"]["param"] == param, body
    if fields.get("tool_choice", "auto") == "auto" and "tools" in fields:
        message = body["error"]["message"]
        assert "--enable-auto-tool-choice" in message and "--tool-call-parser" in message


async def test_a_deep_tool_schema_is_refused_only_when_it_goes_to_the_grammar(
        client: Client, engine: FakeEngine) -> None:
    body = await post(client, 400, messages=answering("x"), tools=TOO_DEEP,
                      tool_choice="required")
    assert body["error"]["message"].startswith(
        f"tools[2].function.parameters is nested more than {MAX_SCHEMA_DEPTH} levels")
    await post(client, messages=answering('{"city": "Paris"}'), tools=TOO_DEEP,
               tool_choice=NAMED)  # only the named tool's parameters are compiled
    assert engine.added[-1].params.structured == StructuredOutput("json", sorted_json(WEATHER))
    await post(client, messages=answering("x"), tools=TOO_DEEP, tool_choice="none")
    assert engine.added[-1].params.structured is None
    await post(client, messages=answering("x"), tools=[deep_tool(MAX_SCHEMA_DEPTH)],
               tool_choice=DEEP_CHOICE)


async def test_tools_too_wide_together_are_refused_only_for_required(
        client: Client, engine: FakeEngine) -> None:
    body = await post(client, 400, messages=answering("x"), tools=TOO_WIDE_TOGETHER,
                      tool_choice="required")
    assert body["error"]["message"].startswith(
        "tools (every function's parameters together, as tool_choice \"required\" constrains "
        f"to any of them) holds 3,003 enum values; at most {TOOL_GRAMMAR_LIMITS.enum_values:,}")
    named = {"type": "function", "function": {"name": "t1"}}
    await post(client, messages=answering('{"v": "001"}'), tools=TOO_WIDE_TOGETHER,
               tool_choice=named)  # one tool's parameters: within SCHEMA_LIMITS
    assert engine.added[-1].params.structured is not None


async def test_128_realistic_tools_fit_the_required_grammar(client: Client,
                                                             engine: FakeEngine) -> None:
    tools = [realistic_tool(i) for i in range(128)]
    schema = required_schema([FunctionDefinition(**t["function"]) for t in tools], True)
    width = schema_width(schema)
    assert all(n <= limit for n, limit in zip(width, TOOL_GRAMMAR_LIMITS, strict=True))
    await post(client, messages=answering('[{"name": "tool_number_0", "parameters": {}}]'),
               tools=tools, tool_choice="required")
    assert engine.added[-1].params.structured == StructuredOutput("json", sorted_json(schema))
