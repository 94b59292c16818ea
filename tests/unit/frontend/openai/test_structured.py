"""Structured-output fields of both generation APIs, against the fake engine: what reaches the
engine, and the 400s for malformed, unsupported or doubled constraints."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from frontend.openai.structured import read_constraint
from shared.messages import StructuredOutput
from tests.unit.fake_engine import FakeEngine

Client = TestClient  # type: ignore[type-arg]

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
SORTED_SCHEMA = '{"properties":{"a":{"type":"string"},"b":{"type":"integer"}},"type":"object"}'
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


def test_read_constraint_without_fields_is_none() -> None:
    assert read_constraint(None, None) is None
