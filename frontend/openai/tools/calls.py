"""Tool calling in chat: `tools`, `tool_choice` and `parallel_tool_calls` read once into a
`ToolPlan`, and a choice's text turned into OpenAI's `tool_calls`, whole or as stream deltas.

As vLLM does:
- `tool_choice` defaults to "none" without tools and to "auto" with them; "auto" needs the
  frontend's `--enable-auto-tool-choice --tool-call-parser NAME` (else a 400 naming them), and
  then generation is free and the parser reads the model's own call format;
- "required" constrains the output to a JSON array of `{"name", "parameters"}` objects, one per
  call (exactly one when parallel_tool_calls is false), each matching one tool's parameters;
- a named function constrains the output to that function's parameters object; its answer's
  finish_reason stays "stop", where "required" and "auto" answer "tool_calls".
The constraint travels like any structured output (a `Constraint` the engine compiles, its
refusal a 400 on `tools`). Assistant messages' call arguments reach the chat template as
objects, and their missing content as "" (most templates fail on a missing content).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import msgspec

from frontend.errors import bad_request
from frontend.openai.protocol.chat import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from frontend.openai.protocol.structured import (
    Constraint,
    SchemaWidth,
    check_schema,
    check_schema_width,
)
from frontend.openai.tools.parsers import (
    AUTO_PARSERS,
    CallArgs,
    CallStart,
    Content,
    NamedCall,
    RequiredCalls,
    ToolEvent,
    ToolExtractor,
)
from shared.messages import StructuredOutput

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# The "required" grammar holds every tool's parameters (each within the structured outputs'
# SCHEMA_LIMITS) and two properties and an enum value (its name) per tool: 128 tools of 16
# parameters, 4 of them optional, one an enum of 16 values, fit. Such a grammar compiles in
# seconds, not in the fraction of one a single schema takes, but once per set of tools: the
# engine caches it by constraint (docs/reliability.md).
TOOL_GRAMMAR_LIMITS = SchemaWidth(properties=2_560, optional_properties=512,
                                  enum_values=2_560, literal_chars=32_768)


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """How a request's answer is read for tool calls, and the constraint that shapes it."""

    mode: Mode
    name: str | None = None  # the named function
    parser: str | None = None  # the auto parser
    constraint: Constraint | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def extractor(self) -> ToolExtractor:
        """A fresh extractor for one choice."""
        if self.mode == "named":
            assert self.name is not None
            return NamedCall(self.name)
        if self.mode == "required":
            return RequiredCalls()
        assert self.parser is not None
        return AUTO_PARSERS[self.parser]()

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """"tool_calls" where calls were made and the output ended by itself (a named call
        keeps "stop", as in vLLM); a cut output keeps "length"."""
        if reason == "stop" and called and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def read_tool_plan(req: ChatCompletionRequest, auto_parser: str | None) -> ToolPlan:
    """The request's tool fields, checked and converted once; raises a 400 naming the field.
    `auto_parser` is the frontend's --tool-call-parser when --enable-auto-tool-choice is on."""
    tools = _read_tools(req.tools)
    choice = _read_choice(req.tool_choice, bool(tools))
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools: set tools, or leave tool_choice out",
                          "tool_choice")
    if choice != "none" and (req.response_format is not None
                             or req.structured_outputs is not None) and choice != "auto":
        raise bad_request("a required or named tool_choice constrains the output itself: it "
                          "cannot be combined with response_format or structured_outputs",
                          "tool_choice")
    if choice == "none":
        return ToolPlan("none")
    if choice == "auto":
        return _auto_plan(auto_parser, req.parallel_tool_calls)
    if choice == "required":
        _check_schemas(tools)
        schema = required_schema(tools, req.parallel_tool_calls)
        check_schema_width(schema, TOOL_GRAMMAR_LIMITS, "tools (every function's parameters "
                           'together, as tool_choice "required" constrains to any of them)',
                           "tools")
        return ToolPlan("required", constraint=_constraint(schema),
                        parallel=req.parallel_tool_calls)
    tool = _find_tool(tools, choice.function.name)
    _check_schemas(tools, tool.name)
    return ToolPlan("named", name=tool.name, constraint=_constraint(_parameters(tool)))


def _auto_plan(parser: str | None, parallel: bool) -> ToolPlan:
    if parser is None:
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                          "--tool-call-parser to be set on the server (or use tool_choice "
                          '"required", "none" or a named function)', "tool_choice")
    return ToolPlan("auto", parser=parser, parallel=parallel)


def _read_tools(tools: list[dict[str, Any]] | None) -> list[FunctionDefinition]:
    try:
        typed = msgspec.convert(tools or [], list[ChatTool])
    except msgspec.ValidationError as exc:
        raise bad_request(f"tools: {exc} (each tool is {{\"type\": \"function\", "
                          "\"function\": {\"name\": ..., \"parameters\": {...}}})",
                          "tools") from None
    return [t.function for t in typed]


def _read_choice(choice: str | dict[str, Any] | None,
                 has_tools: bool) -> Literal["none", "auto", "required"] | NamedToolChoice:
    if choice is None:
        return "auto" if has_tools else "none"
    if choice in ("none", "auto", "required"):
        return choice  # type: ignore[return-value]
    if isinstance(choice, dict):
        try:
            return msgspec.convert(choice, NamedToolChoice)
        except msgspec.ValidationError as exc:
            raise bad_request(f"tool_choice: {exc}", "tool_choice") from None
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                      f'"function": {{"name": ...}}}}, got {choice!r}', "tool_choice")


def _find_tool(tools: list[FunctionDefinition], name: str) -> FunctionDefinition:
    for tool in tools:
        if tool.name == name:
            return tool
    raise bad_request(f"tool_choice names the function {name!r}, which is not in tools",
                      "tool_choice")


def _check_schemas(tools: list[FunctionDefinition], name: str | None = None) -> None:
    """The parameters schemas a constraint is built from (every tool's, or the named tool's)
    within the structured outputs' bounds (`check_schema`); else a 400 on `tools` naming the
    one out of bounds."""
    for i, tool in enumerate(tools):
        if name in (None, tool.name):
            check_schema(_parameters(tool), f"tools[{i}].function.parameters", "tools")


def _parameters(tool: FunctionDefinition) -> dict[str, Any]:
    return tool.parameters if tool.parameters else EMPTY_PARAMETERS


def required_schema(tools: list[FunctionDefinition], parallel: bool) -> dict[str, Any]:
    """An array of calls, each `{"name": <a tool's name>, "parameters": <its parameters>}`;
    every tool's `$defs` move to the root, where their `#/$defs/...` references point."""
    items = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"type": "string", "enum": [tool.name]},
                             "parameters": _without_defs(_parameters(tool))}}
             for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    defs = _shared_defs(tools)
    if defs:
        schema["$defs"] = defs
    return schema


def _without_defs(parameters: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in parameters.items() if k != "$defs"}


def _shared_defs(tools: list[FunctionDefinition]) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    for tool in tools:
        for name, definition in _parameters(tool).get("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise bad_request(f"tools define $defs/{name} twice, differently: rename one",
                                  "tools")
    return defs


def _constraint(schema: dict[str, Any]) -> Constraint:
    text = msgspec.json.encode(schema, order="sorted").decode()
    return Constraint(StructuredOutput("json", text), "tools")


class ToolDelta(NamedTuple):
    """What one piece of a choice's text adds: content text, and tool-call deltas."""

    content: str
    calls: list[DeltaToolCall]


class ChoiceTools:
    """One choice's tool calls, read as its text grows: `read` each piece of text (`final` with
    the last), get content and OpenAI's call deltas (ids given here); `calls()` folds every
    delta read so far into the answer's `tool_calls`. Without parallel calls, only the first
    call is kept."""

    def __init__(self, plan: ToolPlan) -> None:
        self.extractor = plan.extractor()
        self.parallel = plan.parallel
        self._calls: list[ToolCall] = []

    def read(self, text: str, final: bool) -> ToolDelta:
        events = self.extractor.feed(text)
        if final:
            events += self.extractor.finish()
        content = "".join(e.text for e in events if isinstance(e, Content))
        deltas = [self._delta(e) for e in events if self._kept(e)]
        return ToolDelta(content, deltas)

    def calls(self) -> list[ToolCall]:
        return self._calls

    def _kept(self, event: ToolEvent) -> bool:
        return not isinstance(event, Content) and (self.parallel or event.call == 0)

    def _delta(self, event: ToolEvent) -> DeltaToolCall:
        if isinstance(event, CallStart):
            call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", FunctionCall(event.name, ""))
            self._calls.append(call)
            return DeltaToolCall(event.call, DeltaFunctionCall(event.name, ""), call.id,
                                 "function")
        assert isinstance(event, CallArgs)
        self._calls[event.call].function.arguments += event.text
        return DeltaToolCall(event.call, DeltaFunctionCall(arguments=event.text))


def template_messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    """The messages as chat templates expect them (as vLLM passes them): an assistant message's
    call arguments as objects (templates write them with `tojson`), its missing content as ""."""
    return [_for_template(m) if m.role == "assistant" and m.tool_calls else m for m in messages]


def _for_template(message: ChatMessage) -> ChatMessage:
    calls = [_arguments_as_object(call) for call in message.tool_calls or []]
    content = "" if message.content is None else message.content
    return msgspec.structs.replace(message, content=content, tool_calls=calls)


def _arguments_as_object(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"]) if function["arguments"] else {}
    except ValueError:
        return call  # not JSON: the template gets it as written
    return {**call, "function": {**function, "arguments": arguments}}
