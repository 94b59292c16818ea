"""Structured outputs in the OpenAI APIs: the request fields and their conversion, once, into
the engine's `StructuredOutput` constraint.

Two spellings, at most one per request: OpenAI's `response_format` (`text`, `json_object`,
`json_schema`) and vLLM's `structured_outputs` (exactly one of `json`, `regex`, `choice`,
`grammar`, `json_object`). What is cheap to check is checked here, as a 400 naming the field,
and so are the bounds on what the engine's one compile thread may be asked to do (a schema's
nesting, a regex's or grammar's length: compile time grows much faster than either, and a
request holding that thread delays every constrained request behind it), and a schema's width
(`SchemaWidth`: its properties, optional properties, enum values and the characters of its
names and values). A string schema with `pattern` and `minLength`/`maxLength` is refused too:
xgrammar keeps the pattern and drops the lengths (with only a log line), and its regexes have
no lookahead to join them. Whether a schema,
regex or grammar compiles only the engine's grammar compiler can tell (the frontend imports no
grammar engine): it refuses such a request with the compiler's message, which the serving
layer answers as a 400 naming the same field (`Constraint.param`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
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


class SchemaWidth(NamedTuple):
    """What a schema's grammar costs to compile, counted in the whole schema: its objects'
    properties, the optional ones (not in their object's `required`, which cost the most), its
    enum values, and the characters of its property names, definition names, enum and const
    values (OpenAI's measure). Both a schema's counts (`schema_width`) and their bounds."""

    properties: int
    optional_properties: int
    enum_values: int
    literal_chars: int


# One schema (`response_format`, `structured_outputs.json`, one tool's parameters): OpenAI's
# 1,000 enum values, but 1,000 properties and 32 KiB of names and values where OpenAI accepts
# 5,000 and 120,000 (xgrammar's compile time grows faster than either), and 128 optional
# properties (OpenAI's strict schemas have none); at these bounds a schema compiles in
# 0.1-0.7 s (docs/reliability.md). A choice list counts as an enum.
SCHEMA_LIMITS = SchemaWidth(properties=1_000, optional_properties=128, enum_values=1_000,
                            literal_chars=32_768)


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
    check_schema(schema, "response_format.json_schema.schema", "response_format")
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
        check_schema(schema, "structured_outputs.json", "structured_outputs")
        return _schema_text(schema)
    if kind == "choice":
        assert so.choice is not None
        if not so.choice:
            raise bad_request("structured_outputs.choice must hold at least one string",
                              "structured_outputs")
        _check_width(SchemaWidth(0, 0, len(so.choice), sum(map(len, so.choice))),
                     SCHEMA_LIMITS, "structured_outputs.choice", "structured_outputs")
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


def check_schema(schema: dict[str, Any], field: str, param: str) -> None:
    """A 400 naming `field` (its `param`) for a schema the engine should not compile: nested too
    deep, wider than SCHEMA_LIMITS, or with a string bound xgrammar would drop."""
    check_schema_depth(schema, field, param)
    _check_width(schema_width(schema), SCHEMA_LIMITS, field, param)
    _check_string_bounds(schema, field, param)


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


def check_schema_width(schema: dict[str, Any], limits: SchemaWidth, field: str,
                       param: str) -> None:
    """A 400 naming `field` (its `param`) for a schema wider than `limits`."""
    _check_width(schema_width(schema), limits, field, param)


_WIDTH_NAMES = {"properties": "object properties",
                "optional_properties": "optional object properties (not in required)",
                "enum_values": "enum values",
                "literal_chars": "characters of property names, definition names, enum and "
                                 "const values"}


def _check_width(width: SchemaWidth, limits: SchemaWidth, field: str, param: str) -> None:
    for name, count, limit in zip(SchemaWidth._fields, width, limits, strict=True):
        if count > limit:
            raise bad_request(
                f"{field} holds {count:,} {_WIDTH_NAMES[name]}; at most {limit:,} are accepted "
                "(the grammar's compile time grows faster than its size)", param)


# Where a schema holds schemas: one, or a list of them (`items` may be either) ...
_SUBSCHEMAS = frozenset({
    "items", "prefixItems", "additionalItems", "contains", "additionalProperties",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems", "anyOf", "oneOf", "allOf",
    "not", "if", "then", "else"})
# ... or a map of names to schemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "dependentSchemas", "$defs",
                          "definitions"})


def subschemas(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """`schema` and every schema object in it, reached through schema keywords only (an enum
    value or a default that looks like a schema is data, not a schema). Iterative."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif key in _SUBSCHEMAS:
                stack.extend(value if isinstance(value, list) else [value])


def schema_width(schema: dict[str, Any]) -> SchemaWidth:
    """The properties, optional properties, enum values and literal characters of `schema`."""
    properties = optional = enum_values = chars = 0
    for node in subschemas(schema):
        props = node.get("properties")
        if isinstance(props, dict):
            required = node.get("required")
            listed = set(required) if isinstance(required, list) else set()
            properties += len(props)
            optional += sum(1 for name in props if name not in listed)
            chars += sum(map(len, props))
        for key in ("$defs", "definitions"):
            if isinstance(node.get(key), dict):
                chars += sum(map(len, node[key]))
        enum = node.get("enum")
        if isinstance(enum, list):
            enum_values += len(enum)
            chars += sum(map(_literal_chars, enum))
        if "const" in node:
            chars += _literal_chars(node["const"])
    return SchemaWidth(properties, optional, enum_values, chars)


def _literal_chars(value: Any) -> int:
    return len(value) if isinstance(value, str) else len(msgspec.json.encode(value))


def _check_string_bounds(schema: dict[str, Any], field: str, param: str) -> None:
    """A 400 for a string schema with both `pattern` and `minLength`/`maxLength`: xgrammar
    enforces the pattern and silently drops the lengths, and its regex dialect (no lookahead)
    cannot join them, so the output could break the schema it was promised to follow."""
    for node in subschemas(schema):
        bounds = [k for k in ("minLength", "maxLength") if k in node]
        if isinstance(node.get("pattern"), str) and bounds:
            raise bad_request(
                f"{field} has a string schema with both pattern {node['pattern']!r} and "
                f"{' and '.join(bounds)}, which cannot be enforced together; put the length "
                'into the pattern (e.g. "^[a-z]{3,8}$") and remove '
                f"{' and '.join(bounds)}", param)


def _schema_text(schema: dict[str, Any]) -> str:
    """The schema as canonical JSON text: the same schema is the same compile-cache key."""
    return msgspec.json.encode(schema, order="sorted").decode()
