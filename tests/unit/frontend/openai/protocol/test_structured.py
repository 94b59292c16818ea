"""Structured-output fields of both generation APIs, against the fake engine: what reaches the
engine, and the 400s for malformed, unsupported or doubled constraints."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient

from frontend.openai.protocol.structured import (
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_CHARS,
    SCHEMA_LIMITS,
    SchemaWidth,
    StructuredOutputsParams,
    nesting_depth,
    read_constraint,
    schema_width,
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


def enum_schema(values: int, length: int = 4) -> dict[str, Any]:
    """An object with one string property: an enum of `values` distinct strings of `length`."""
    enum = [f"{i:0{length}d}" for i in range(values)]
    return {"type": "object", "properties": {"e": {"enum": enum}}, "required": ["e"]}


def wide_object(properties: int, optional: int = 0) -> dict[str, Any]:
    """An object of `properties` string properties, the last `optional` of them optional."""
    names = [f"p{i}" for i in range(properties)]
    return {"type": "object", "properties": {n: {"type": "string"} for n in names},
            "required": names[:properties - optional]}


# Issue 15's kind of wide schema: an enum of 26,214 strings held the compile thread 10.6 s.
WIDE_ENUM = enum_schema(26_214, 9)
# 250 optional properties in each of 4 objects took 3.6 s to compile.
OPTIONAL_OBJECTS = {"type": "object", "properties": {
    f"o{i}": wide_object(250, 250) for i in range(4)}}
# Over SCHEMA_LIMITS.literal_chars by one: 8 values of 4,096 characters, and one more.
LONG_VALUES = {"anyOf": [{"enum": ["x" * 4_096] * 8}, {"const": "y"}]}
# xgrammar keeps the pattern and drops the length: "abcdefgh" would pass for maxLength 3.
PATTERN_AND_LENGTH = {"type": "object", "required": ["code"], "properties": {
    "code": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}}}
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
    ({"structured_outputs": {"json": WIDE_ENUM}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": enum_schema(SCHEMA_LIMITS.enum_values + 1)}}}, "response_format"),
    ({"structured_outputs": {"json": wide_object(SCHEMA_LIMITS.properties + 1)}},
     "structured_outputs"),
    ({"structured_outputs": {"json": OPTIONAL_OBJECTS}}, "structured_outputs"),
    ({"structured_outputs": {"json": wide_object(200, SCHEMA_LIMITS.optional_properties + 1)}},
     "structured_outputs"),
    ({"structured_outputs": {"json": LONG_VALUES}}, "structured_outputs"),
    ({"structured_outputs": {"choice": [str(i) for i in range(SCHEMA_LIMITS.enum_values + 1)]}},
     "structured_outputs"),
    ({"structured_outputs": {"choice": ["x" * 4_096] * 8 + ["y"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": PATTERN_AND_LENGTH}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"anyOf": [
            {"type": "integer"}, {"type": "string", "pattern": "a+", "minLength": 2}]}}}}},
     "response_format"),
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


def text(schema: dict[str, Any]) -> str:
    return msgspec.json.encode(schema, order="sorted").decode()


AS_DEEP_AS_ALLOWED = nested_arrays(MAX_SCHEMA_DEPTH)
AT_THE_BOUNDS = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": AS_DEEP_AS_ALLOWED}}},
     StructuredOutput("json", msgspec.json.encode(AS_DEEP_AS_ALLOWED, order="sorted").decode())),
    ({"structured_outputs": {"regex": "a" * MAX_SPEC_CHARS}},
     StructuredOutput("regex", "a" * MAX_SPEC_CHARS)),
    *[({"structured_outputs": {"json": schema}}, StructuredOutput("json", text(schema)))
      for schema in (enum_schema(SCHEMA_LIMITS.enum_values),
                     wide_object(SCHEMA_LIMITS.properties, SCHEMA_LIMITS.optional_properties),
                     {"enum": ["x" * 4_096] * 8})],
    ({"structured_outputs": {"choice": ["x" * 4_096] * 8}},
     StructuredOutput("choice", json.dumps(["x" * 4_096] * 8))),
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


async def test_a_wide_schema_is_refused_with_its_count_and_limit(client: Client) -> None:
    resp = await client.post("/v1/completions", json={
        "prompt": "Hello", "structured_outputs": {"json": WIDE_ENUM}})
    message = (await resp.json())["error"]["message"]
    assert resp.status == 400
    assert message.startswith(f"structured_outputs.json holds 26,214 enum values; at most "
                              f"{SCHEMA_LIMITS.enum_values:,} are accepted"), message


async def test_a_pattern_with_a_length_is_refused_with_a_way_out(client: Client) -> None:
    resp = await client.post("/v1/completions", json={
        "prompt": "Hello", "structured_outputs": {"json": PATTERN_AND_LENGTH}})
    message = (await resp.json())["error"]["message"]
    assert resp.status == 400
    assert "pattern '^[a-z]+$' and maxLength" in message and "{3,8}" in message, message


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^[a-z]{1,3}$"},
    {"type": "string", "minLength": 1, "maxLength": 3},
    # Property names and data are not schema keywords: nothing here is a bounded pattern.
    {"type": "object", "properties": {"pattern": {"type": "string"},
                                      "maxLength": {"type": "integer"}}},
    {"enum": [{"pattern": "a", "maxLength": 1}]},
])
def test_only_a_schema_with_both_a_pattern_and_a_length_is_refused(schema: dict[str, Any]) -> None:
    assert read_constraint(None, msgspec.convert({"json": schema}, StructuredOutputsParams))


@pytest.mark.parametrize(("schema", "width"), [
    ({"type": "string"}, SchemaWidth(0, 0, 0, 0)),
    ({"type": "object", "properties": {"ab": {"const": 12}, "c": {"enum": ["xyz", None]}},
      "required": ["ab"]}, SchemaWidth(2, 1, 2, 3 + 2 + 3 + 4)),
    ({"$defs": {"node": {"type": "object", "properties": {"n": {"$ref": "#/$defs/node"}}}},
      "anyOf": [{"$ref": "#/$defs/node"}, {"type": "array", "items": {"enum": [1, 2]}}]},
     SchemaWidth(1, 1, 2, 4 + 1 + 2)),
    # An enum value shaped like a schema is data: its "properties" are not counted.
    ({"enum": [{"properties": {"a": {}}}]}, SchemaWidth(0, 0, 1, 23)),
])
def test_schema_width_counts_properties_enums_and_literals(schema: dict[str, Any],
                                                           width: SchemaWidth) -> None:
    assert schema_width(schema) == width


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
