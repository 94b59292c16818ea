"""The Responses API end to end through `tandem serve` on the random-weight tiny model, with the
openai SDK: plain and streamed answers that agree, the SDK's stream helper, a function call and
its round trip, a named call, structured text (json_schema and `responses.parse`), a Codex-shaped
request, the store, and 400s naming the field."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.server import Server

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 10},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS: Any = [
    {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "description": "The time in a zone",
     "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                    "required": ["zone"], "additionalProperties": False}},
]
ANSWER = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                          "maximum": 99}}}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(tiny_llama, tmp_path_factory.mktemp("responses"), "--max-model-len", "1024",
                 "--tool-call-parser", "hermes", "--responses-store-size", "4")
    yield srv.wait_healthy()
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


def joined(client: openai.OpenAI, **args: Any) -> tuple[list[Any], list[Any]]:
    """The streamed events (checked in order) and the final response's output."""
    events = list(client.responses.create(model="m", stream=True, **args))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events, events[-1].response.output


def same_items(a: list[Any], b: list[Any]) -> bool:
    def shape(item: Any) -> dict[str, Any]:
        return item.model_dump(exclude={"id", "call_id"})
    return [shape(i) for i in a] == [shape(i) for i in b]


def test_plain_and_streamed_answers_agree(client: openai.OpenAI) -> None:
    args: Any = dict(input=ASK, instructions="Answer briefly.", max_output_tokens=24,
                     temperature=0.0)
    response = client.responses.create(model="m", **args)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 24
    assert response.usage.total_tokens == response.usage.input_tokens + 24
    [message] = response.output
    assert message.type == "message" and response.output_text
    events, output = joined(client, **args)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text and same_items(output, response.output)


def test_the_sdk_stream_helper_and_structured_text(client: openai.OpenAI) -> None:
    text: Any = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER,
                            "strict": True}}
    args: Any = dict(input="Is it sunny? How many days?", text=text, max_output_tokens=120,
                     temperature=0.0)
    response = client.responses.create(model="m", **args)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), ANSWER)
    with client.responses.stream(model="m", **args) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == response.output_text


class Answer(pydantic.BaseModel):
    ok: bool
    n: int = pydantic.Field(ge=0, le=99)


def test_parse_into_a_pydantic_model(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model="m", input="Is it sunny?", text_format=Answer,
                                    max_output_tokens=120, temperature=0.0)
    assert isinstance(parsed.output_parsed, Answer)


def test_a_function_call_and_its_round_trip(client: openai.OpenAI) -> None:
    args: Any = dict(input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=300,
                     temperature=0.0, parallel_tool_calls=False)
    response = client.responses.create(model="m", **args)
    [call] = response.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.name in ("get_weather", "get_time")
    schema = {t["name"]: t["parameters"] for t in TOOLS}[call.name]
    jsonschema.validate(json.loads(call.arguments, strict=False), schema)
    events, output = joined(client, **args)
    assert same_items(output, response.output)
    assert "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta") == call.arguments
    history: Any = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
                    {"type": "function_call_output", "call_id": call.call_id,
                     "output": '{"temperature": 21}'}]
    answer = client.responses.create(model="m", input=history, tools=TOOLS, tool_choice="none",
                                     max_output_tokens=8, temperature=0.0)
    assert [item.type for item in answer.output] == ["message"]
    assert answer.usage is not None and answer.usage.input_tokens > response.usage.input_tokens


def test_a_named_function(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="m", input="What time is it?", tools=TOOLS, max_output_tokens=100,
        tool_choice={"type": "function", "name": "get_time"}, temperature=0.0)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_time"
    assert json.loads(call.arguments)["zone"] in ("UTC", "CET")


def test_auto_tool_choice_answers(client: openai.OpenAI) -> None:
    """Codex's default: free generation read by the hermes parser (a random model calls
    nothing, so the answer is a message)."""
    response = client.responses.create(model="m", input=ASK, tools=TOOLS,
                                       max_output_tokens=16, temperature=0.0)
    assert response.output and response.status in ("completed", "incomplete")


def test_a_codex_shaped_request(server: Server) -> None:
    body = {
        "model": "m", "instructions": "You are Codex, a coding agent.",
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "<permissions>sandboxed</permissions>"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "List the files."}]},
            {"type": "function_call", "call_id": "call_1", "name": "shell",
             "arguments": '{"command": ["ls"]}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "README.md"},
        ],
        "tools": [{"type": "function", "name": "shell", "description": "Runs a command",
                   "strict": False, "parameters": {
                       "type": "object", "required": ["command"], "additionalProperties": False,
                       "properties": {"command": {"type": "array",
                                                  "items": {"type": "string"}}}}}],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "019a-5e2c",
        "client_metadata": {"x-codex-turn": "1"}, "max_output_tokens": 16,
    }
    status, headers, raw = post(server, body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    blocks = [b for b in raw.decode().split("\n\n") if b]
    events = [json.loads(b.split("\ndata: ")[1]) for b in blocks]
    assert [b.split("\n")[0] for b in blocks] == [f"event: {e['type']}" for e in events]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert events[-1]["response"]["store"] is False


def test_the_store_continues_a_response(client: openai.OpenAI) -> None:
    first = client.responses.create(model="m", input="My name is Ada.", max_output_tokens=4,
                                    temperature=0.0)
    follow = client.responses.create(model="m", input="What is my name?", max_output_tokens=4,
                                     temperature=0.0, previous_response_id=first.id)
    alone = client.responses.create(model="m", input="What is my name?", max_output_tokens=4,
                                    temperature=0.0)
    assert follow.previous_response_id == first.id
    assert follow.usage is not None and alone.usage is not None and first.usage is not None
    assert follow.usage.input_tokens > alone.usage.input_tokens + first.usage.input_tokens // 2
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", input="x", previous_response_id="resp_unknown")
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]


@pytest.mark.parametrize(("args", "param"), [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": "x", "max_output_tokens": -5}, "max_output_tokens"),
    ({"input": "x", "tool_choice": "required",
      "tools": [{"type": "function", "name": "f", "parameters": {"type": "wat"}}]}, "tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                        "schema": {"type": "wat"}}}}, "text.format"),
])
def test_bad_requests_are_400s_naming_the_field(client: openai.OpenAI, args: dict[str, Any],
                                                param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", **args)
    assert caught.value.body["param"] == param  # type: ignore[index]


def test_missing_input_is_a_400(server: Server) -> None:
    status, _, raw = post(server, {"model": "m"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "input"


def post(server: Server, body: dict[str, Any]) -> tuple[int, Any, bytes]:
    """A raw POST /v1/responses: status, headers, body."""
    request = urllib.request.Request(f"{server.url}/v1/responses", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()
