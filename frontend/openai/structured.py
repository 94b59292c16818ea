"""Structured outputs in the OpenAI APIs: the request fields and their conversion, once, into
the engine's `StructuredOutput` constraint.

Two spellings, at most one per request: OpenAI's `response_format` (`text`, `json_object`,
`json_schema`) and vLLM's `structured_outputs` (exactly one of `json`, `regex`, `choice`,
`grammar`, `json_object`). What is cheap to check is checked here, as a 400 naming the field,
and so are the bounds on what the engine's one compile thread may be asked to do (a schema's
nesting, a regex's or grammar's length: compile time grows much faster than either, and a
request holding that thread delays every constrained request behind it). Whether a schema,
regex or grammar compiles only the engine's grammar compiler can tell (the frontend imports no
grammar engine): it refuses such a request with the compiler's message, which the serving
layer answers as a 400 naming the same field (`Constraint.param`).
"""

from __future__ import annotations

import json
from typing import Any, Literal, NamedTuple

import msgspec

from frontend.errors import bad_request
from shared.messages import StructuredOutput

# A schema's nesting is counted in the JSON objects and arrays of the schema document: an object
# property takes two levels (its schema and "properties"), an array's items one, a union two
# ("anyOf" and its list), a "$ref" to a definition in "$defs" none. OpenAI's structured outputs
# accept 10 levels of nested objects; 64 holds those even with a union at every level, and the
# compile time of a schema at this bound stays in milliseconds (docs/reliability.md).
MAX_SCHEMA_DEPTH = 64
# The longest regex, grammar or choice list (as JSON) accepted: hand-written ones are a few KiB,
# and the compile time of a longer one grows faster than its square (docs/reliability.md).
MAX_SPEC_CHARS = 65_536


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """`response_format.json_schema` as OpenAI defines it."""

    name: str
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`. Unknown fields are a 400: an option silently ignored would
    let through outputs its user believes constrained."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # Properties a schema does not list are never generated anyway (the engine's strict mode).
    disable_additional_properties: bool = False
    disable_any_whitespace: bool = False


class Constraint(NamedTuple):
    """A request's constraint for the engine, and the request field it came from."""

    output: StructuredOutput
    param: str


def read_constraint(response_format: ResponseFormat | None,
                    structured: StructuredOutputsParams | None) -> Constraint | None:
    """The request's constraint, if any; raises a 400 for one that is malformed or doubled."""
    from_format = _from_response_format(response_format)
    from_vllm = _from_structured_outputs(structured)
    if from_format is not None and from_vllm is not None:
        raise bad_request(
            "response_format and structured_outputs cannot both constrain the output; "
            "use one of them", "structured_outputs")
    return from_format or from_vllm


def _from_response_format(fmt: ResponseFormat | None) -> Constraint | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint(StructuredOutput("json_object"), "response_format")
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise bad_request(
            'response_format of type "json_schema" needs json_schema.schema (a JSON schema '
            "object)", "response_format")
    schema = fmt.json_schema.schema
    check_schema_depth(schema, "response_format.json_schema.schema", "response_format")
    return Constraint(StructuredOutput("json", _schema_text(schema)), "response_format")


def _from_structured_outputs(so: StructuredOutputsParams | None) -> Constraint | None:
    if so is None:
        return None
    kinds = [k for k, v in (("json", so.json), ("regex", so.regex), ("choice", so.choice),
                            ("grammar", so.grammar), ("json_object", so.json_object or None))
             if v is not None]
    if len(kinds) != 1:
        raise bad_request(
            "structured_outputs must set exactly one of json, regex, choice, grammar or "
            f"json_object (got {', '.join(kinds) if kinds else 'none'})", "structured_outputs")
    kind = kinds[0]
    any_ws = not so.disable_any_whitespace
    return Constraint(StructuredOutput(kind, _spec(so, kind), any_ws), "structured_outputs")


def _spec(so: StructuredOutputsParams, kind: str) -> str:
    if kind == "json":
        schema = _parse_schema(so.json)
        check_schema_depth(schema, "structured_outputs.json", "structured_outputs")
        return _schema_text(schema)
    if kind == "choice":
        assert so.choice is not None
        if not so.choice:
            raise bad_request("structured_outputs.choice must hold at least one string",
                              "structured_outputs")
        return _bounded(json.dumps(so.choice, ensure_ascii=False), "choice (as JSON)")
    if kind in ("regex", "grammar"):
        text = so.regex if kind == "regex" else so.grammar
        if not text:
            raise bad_request(f"structured_outputs.{kind} must not be empty",
                              "structured_outputs")
        return _bounded(text, kind)
    return ""  # json_object


def _bounded(spec: str, what: str) -> str:
    if len(spec) > MAX_SPEC_CHARS:
        raise bad_request(
            f"structured_outputs.{what} is {len(spec):,} characters long; at most "
            f"{MAX_SPEC_CHARS:,} are accepted", "structured_outputs")
    return spec


def _parse_schema(schema: str | dict[str, Any] | None) -> dict[str, Any]:
    if isinstance(schema, dict):
        return schema
    try:
        parsed = json.loads(schema or "")
    except ValueError as exc:
        raise bad_request(f"structured_outputs.json is not valid JSON: {exc}",
                          "structured_outputs") from None
    if not isinstance(parsed, dict):
        raise bad_request("structured_outputs.json must be a JSON schema object",
                          "structured_outputs")
    return parsed


def check_schema_depth(schema: dict[str, Any], field: str, param: str) -> None:
    """A 400 naming `field` (its `param`) for a schema nested deeper than MAX_SCHEMA_DEPTH."""
    if nesting_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise bad_request(
            f"{field} is nested more than {MAX_SCHEMA_DEPTH} levels deep (counting its JSON "
            'objects and arrays: a nested object takes two, its schema and "properties"); '
            'flatten it, or move nested schemas into "$defs" and point to them with "$ref"',
            param)


def nesting_depth(value: Any, limit: int) -> int:
    """How deeply `value`'s dicts and lists nest (a scalar 0, `{}` 1), counted no further than
    `limit` + 1. Iterative: whatever depth the JSON decoder let through is measured."""
    deepest = 0
    stack = [(value, 1)]
    while stack and deepest <= limit:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in node)
    return deepest


def _schema_text(schema: dict[str, Any]) -> str:
    """The schema as canonical JSON text: the same schema is the same compile-cache key."""
    return msgspec.json.encode(schema, order="sorted").decode()
