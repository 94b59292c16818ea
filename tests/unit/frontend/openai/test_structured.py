"""Structured-output fields of both generation APIs, against the fake engine: what reaches the
engine, and the 400s for malformed, unsupported or doubled constraints."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient

from frontend.openai.structured import (
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_CHARS,
    nesting_depth,
    read_constraint,
)
from shared.messages import StructuredOutput
from tests.unit.fake_engine import FakeEngine

Client = TestClient  # type: ignore[type-arg]

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
SORTED_SCHEMA = '{"properties":{"a":{"type":"string"},"b":{"type":"integer"}},"type":"object"}'


def nested_arrays(depth: int) -> dict[str, Any]:
    """A schema `depth` JSON objects and arrays deep: arrays of arrays of ... strings."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


# Issue 15's kind of schema: objects in objects, two levels each; 200 of them took the engine's
# one compile thread 1.3 s, 450 about 20 s. Sent as text, as a client would build it.
DEEP_OBJECTS = ('{"type": "object", "properties": {"a": ' * 200 + '{"type": "string"}'
                + "}}" * 200)
ENDPOINTS = {
    "/v1/completions": {"prompt": "Hello"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
}

SENT = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutput("json", SORTED_SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json", SORTED_SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}},
     StructuredOutput("json", SORTED_SCHEMA, any_whitespace=False)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutput("regex", "[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no \"way\""]}},
     StructuredOutput("choice", '["yes", "no \\"way\\""]')),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}},
     StructuredOutput("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True, "disable_additional_properties": True}},
     StructuredOutput("json_object")),
]

BAD = [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    # A missing field is named as the decoder names it (the message gives its path).
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs"),
    ({"structured_outputs": {"choice": [1, 2]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "min_tokens": 2}, "min_tokens"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": nested_arrays(MAX_SCHEMA_DEPTH + 1)}}}, "response_format"),
    ({"structured_outputs": {"json": nested_arrays(MAX_SCHEMA_DEPTH + 1)}},
     "structured_outputs"),
    ({"structured_outputs": {"json": DEEP_OBJECTS}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a" * (MAX_SPEC_CHARS + 1)}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": f'root ::= "{"a" * MAX_SPEC_CHARS}"'}},
     "structured_outputs"),
    ({"structured_outputs": {"choice": ["a" * MAX_SPEC_CHARS]}}, "structured_outputs"),
]


@pytest.mark.parametrize("path", list(ENDPOINTS))
@pytest.mark.parametrize(("fields", "expected"), SENT)
async def test_constraint_reaches_the_engine(client: Client, engine: FakeEngine, path: str,
                                             fields: dict[str, Any],
                                             expected: StructuredOutput | None) -> None:
    body = {**ENDPOINTS[path], "max_tokens": 2, **fields}
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    assert engine.added[-1].params.structured == expected


@pytest.mark.parametrize("path", list(ENDPOINTS))
@pytest.mark.parametrize(("fields", "param"), BAD)
async def test_bad_constraint_is_a_400_naming_the_field(client: Client, engine: FakeEngine,
                                                         path: str, fields: dict[str, Any],
                                                         param: str) -> None:
    for stream in (False, True):
        resp = await client.post(path, json={**ENDPOINTS[path], "stream": stream, **fields})
        assert resp.status == 400, await resp.text()
        error = (await resp.json())["error"]
        assert error["param"] == param, error
        assert param in error["message"] or "response_format" in error["message"], error
    assert engine.added == []


async def test_engine_refusal_of_a_constraint_names_the_field(
        client: Client, engine: FakeEngine) -> None:
    engine.error_prompt_len = 1  # the fake engine refuses every request, as a bad regex would be
    for stream in (False, True):
        resp = await client.post("/v1/completions", json={
            "prompt": "Hello", "stream": stream, "structured_outputs": {"regex": "("}})
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "structured_outputs"


AS_DEEP_AS_ALLOWED = nested_arrays(MAX_SCHEMA_DEPTH)
AT_THE_BOUNDS = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": AS_DEEP_AS_ALLOWED}}},
     StructuredOutput("json", msgspec.json.encode(AS_DEEP_AS_ALLOWED, order="sorted").decode())),
    ({"structured_outputs": {"regex": "a" * MAX_SPEC_CHARS}},
     StructuredOutput("regex", "a" * MAX_SPEC_CHARS)),
]


@pytest.mark.parametrize(("fields", "expected"), AT_THE_BOUNDS)
async def test_constraints_at_the_bounds_reach_the_engine(
        client: Client, engine: FakeEngine, fields: dict[str, Any],
        expected: StructuredOutput) -> None:
    resp = await client.post("/v1/completions", json={"prompt": "Hello", **fields})
    assert resp.status == 200, await resp.text()
    assert engine.added[-1].params.structured == expected


async def test_a_deep_schema_is_refused_with_its_field_and_a_way_out(client: Client) -> None:
    resp = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}],
        "structured_outputs": {"json": DEEP_OBJECTS}})
    message = (await resp.json())["error"]["message"]
    assert resp.status == 400
    assert f"structured_outputs.json is nested more than {MAX_SCHEMA_DEPTH} levels" in message
    assert "$defs" in message and "$ref" in message


@pytest.mark.parametrize(("value", "depth"), [
    (3, 0), ({}, 1), ([], 1), ({"a": [1, {"b": "c"}]}, 3), ([[], [[{}]]], 4),
    (nested_arrays(MAX_SCHEMA_DEPTH), MAX_SCHEMA_DEPTH),
])
def test_nesting_depth_counts_objects_and_arrays(value: Any, depth: int) -> None:
    assert nesting_depth(value, MAX_SCHEMA_DEPTH) == depth


def test_nesting_depth_stops_past_the_limit_at_any_depth() -> None:
    deep: list[Any] = []
    for _ in range(100_000):  # far beyond the interpreter's recursion limit
        deep = [deep]
    assert nesting_depth(deep, 10) == 11


def test_read_constraint_without_fields_is_none() -> None:
    assert read_constraint(None, None) is None
