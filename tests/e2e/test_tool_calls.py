"""Tool calling end to end through `tandem serve` on the random-weight tiny model, with the openai
SDK: "required" and named calls whose arguments validate against the tool's schema (the model
alone would write gibberish), stream == non-stream, a call → tool result → answer round trip,
and "auto" with the hermes parser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.server import Server

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 10},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "unit": {"enum": ["C", "F"]}}}
TIME = {"type": "object", "required": ["zone"],
        "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(tiny_llama, tmp_path_factory.mktemp("tools"), "--max-model-len", "1024",
                 "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv.wait_healthy()
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


def streamed(client: openai.OpenAI, **args: Any) -> tuple[list[tuple[str, str]], str | None]:
    """The streamed calls joined, as (name, arguments), and the finish reason."""
    calls: list[list[str]] = []
    finish = None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            for call in c.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index == len(call_list := calls) and call.function
                    call_list.append([call.function.name or "", ""])
                assert call.function is not None
                calls[call.index][1] += call.function.arguments or ""
            finish = c.finish_reason or finish
    return [(name, args) for name, args in calls], finish


def check_calls(message: Any, cut: bool = False) -> list[tuple[str, str]]:
    """The message's calls, each checked against its tool's schema (but for the last when the
    output was `cut` by max_tokens)."""
    assert message.content is None and message.tool_calls
    for call in message.tool_calls[: -1 if cut else None]:
        assert call.id.startswith("call_") and call.type == "function"
        # strict=False: xgrammar's JSON strings admit a raw tab (strict JSON wants "\\t"); an
        # engine grammar matter, reported, not a tool-calling one
        arguments = json.loads(call.function.arguments, strict=False)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


@pytest.mark.parametrize(("seed", "temperature"), [(0, 0.0), (1, 0.8), (2, 1.2)])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_validate(client: openai.OpenAI, seed: int, temperature: float,
                                 parallel: bool) -> None:
    """Without parallel calls, exactly one; with them, the random model keeps adding calls, so
    max_tokens may cut the last one."""
    args: Any = dict(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                     parallel_tool_calls=parallel, max_tokens=300, temperature=temperature,
                     seed=seed)
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "tool_calls" or (parallel and choice.finish_reason == "length")
    calls = check_calls(choice.message, cut=choice.finish_reason == "length")
    assert parallel or len(calls) == 1
    assert streamed(client, **args) == (calls, choice.finish_reason)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_named_call_validates(client: openai.OpenAI, name: str) -> None:
    args: Any = dict(model="m", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0.0,
                     tool_choice={"type": "function", "function": {"name": name}})
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "stop"
    calls = check_calls(choice.message)
    assert [n for n, _ in calls] == [name]
    assert streamed(client, **args) == (calls, "stop")


def test_round_trip_call_result_answer(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300,
        temperature=0.0, parallel_tool_calls=False).choices[0].message
    (call,) = first.tool_calls or []
    messages: Any = [*ASK, first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    answer = client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                            tool_choice="none", max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.usage is not None and answer.usage.prompt_tokens > 10


def test_auto_with_hermes_answers(client: openai.OpenAI) -> None:
    """Free generation: a random model writes no call, so the text comes back as content."""
    args: Any = dict(model="m", messages=ASK, tools=TOOLS, max_tokens=20, temperature=0.0)
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


def test_tool_choice_without_tools_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        client.chat.completions.create(model="m", messages=ASK, tool_choice="required",
                                       max_tokens=5)


def test_a_schema_the_engine_cannot_compile_is_a_400_on_tools(client: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=ASK, tools=tools,
                                       tool_choice="required", max_tokens=5)
    assert caught.value.body["param"] == "tools"  # type: ignore[index]
