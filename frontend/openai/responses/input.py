"""A Responses API request turned into a chat request, once, top to bottom: its input items as
chat messages, its tools, tool_choice and text.format as chat's fields. Every problem is a 400
naming the Responses field (`input`, `tools`, `tool_choice`, `text.format`).

Input items, as OpenAI defines them:
- `message` (its `type` may be left out): a role and text content, a string or parts
  (`input_text`, `output_text`, joined as chat joins text parts);
- `function_call` (call_id, name, arguments): a call the assistant made, folded into the
  assistant message before it, as chat templates expect calls;
- `function_call_output` (call_id, output): the call's result, a `tool` message;
- `reasoning`: its text (`content`, else `summary`) is the next assistant message's reasoning,
  which the template renders or drops as it does for chat history.
Output items are input items too: a stored response's output continues a conversation the same
way (`output_messages`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from frontend.errors import bad_request
from frontend.openai.protocol.chat import ChatCompletionRequest, ChatMessage, ContentPart
from frontend.openai.responses.protocol import ResponsesRequest, TextFormat

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
REASONING_PARTS = ("reasoning_text", "summary_text")


class FunctionTool(msgspec.Struct, kw_only=True):
    """A Responses function tool: the chat tool's fields, one level up."""

    type: str
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def chat_request(req: ResponsesRequest, messages: Sequence[ChatMessage],
                 defaults: Mapping[str, Any]) -> ChatCompletionRequest:
    """The chat request that answers `req` with these `messages` (its instructions, the history
    it continues, its input): the model's generation defaults fill the sampling fields `req`
    leaves out, as in chat."""
    fields: dict[str, Any] = {
        "model": req.model, "messages": [msgspec.to_builtins(m) for m in messages],
        "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format(req.text.format if req.text else None),
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "user": req.user, "seed": req.seed, "top_k": req.top_k,
        "logit_bias": req.logit_bias,
    }
    given = {k: v for k, v in fields.items() if v is not None}
    return msgspec.convert({**defaults, **given}, ChatCompletionRequest)


def input_messages(given: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """The input as chat messages: a string is one user message."""
    if isinstance(given, str):
        return [ChatMessage(role="user", content=given)]
    messages = conversation_messages(given)
    if not messages:
        raise bad_request("input must hold at least one message", "input")
    return messages


def output_messages(items: Sequence[Any]) -> list[ChatMessage]:
    """A response's output items as the assistant's turn (a response that only thought: an
    assistant message with its reasoning and no content)."""
    return conversation_messages(items, reasoning_alone=True)


def instructions_message(instructions: str | None) -> list[ChatMessage]:
    """The instructions as the system message that opens the chat (none without them)."""
    return [ChatMessage(role="system", content=instructions)] if instructions else []


def conversation_messages(items: Sequence[Any],
                          reasoning_alone: bool = False) -> list[ChatMessage]:
    """Input (or output) items as chat messages; raises a 400 naming the item. A reasoning
    item that no assistant message follows is dropped, or with `reasoning_alone` an assistant
    message of its own."""
    messages: list[ChatMessage] = []
    reasoning: str | None = None  # a reasoning item's text, for the next assistant message
    for i, item in enumerate(items):
        kind = _item_type(i, item)
        if kind == "reasoning":
            reasoning = (reasoning or "") + _reasoning_text(i, item)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(ChatMessage(role="tool", tool_call_id=_string(i, item, "call_id"),
                                        content=_text(i, output, "output")))
        elif kind == "function_call":
            call = {"id": _string(i, item, "call_id"), "type": "function",
                    "function": {"name": _string(i, item, "name"),
                                 "arguments": _string(i, item, "arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call],
                                            reasoning=reasoning))
            reasoning = None
        else:
            message = _message(i, item)
            if message.role == "assistant":
                message.reasoning, reasoning = reasoning, None
            messages.append(message)
    if reasoning and reasoning_alone:
        messages.append(ChatMessage(role="assistant", reasoning=reasoning))
    return messages


def _item_type(i: int, item: Any) -> str:
    if not isinstance(item, dict):
        raise bad_request(f"input[{i}] must be an object (an input item)", "input")
    kind = item.get("type", "message" if "role" in item else None)
    if kind not in ITEM_TYPES:
        raise bad_request(f"input[{i}].type {kind!r} is not supported (use one of "
                          f"{', '.join(ITEM_TYPES)})", "input")
    return str(kind)


def _message(i: int, item: dict[str, Any]) -> ChatMessage:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise bad_request(f"input[{i}].role {role!r} is not supported (use one of "
                          f"{', '.join(MESSAGE_ROLES)})", "input")
    return ChatMessage(role=role, content=_text(i, item.get("content"), "content"))


def _text(i: int, content: Any, name: str) -> str | list[ContentPart]:
    """A string, or text parts (chat's, which the template gets joined as chat joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"input[{i}].{name} must be a string or a list of text parts",
                          "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"input[{i}].{name}[{j}]: only text parts ({', '.join(TEXT_PARTS)}"
                              f" with a text) are supported, got type {kind!r}", "input")
        parts.append(ContentPart("text", part["text"]))
    return parts


def _string(i: int, item: dict[str, Any], name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"input[{i}].{name} must be a string ({item.get('type')} item)",
                          "input")
    return value


def _reasoning_text(i: int, item: dict[str, Any]) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(
            isinstance(p, dict) and p.get("type") in REASONING_PARTS
            and isinstance(p.get("text"), str) for p in parts):
        raise bad_request(f"input[{i}]: a reasoning item's content and summary are lists of "
                          "reasoning_text and summary_text parts", "input")
    return "".join(p["text"] for p in parts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat's shape; any other tool type is a 400."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}].type {kind!r} is not supported: only function tools "
                              '({"type": "function", "name": ..., "parameters": {...}})',
                              "tools")
        try:
            fn = msgspec.convert(tool, FunctionTool)
        except msgspec.ValidationError as exc:
            raise bad_request(f"tools[{i}]: {exc}", "tools") from None
        function = {k: v for k, v in msgspec.structs.asdict(fn).items()
                    if k != "type" and v is not None}
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """"none" / "auto" / "required" as they are; {"type": "function", "name"} in chat's shape."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                      f'"name": ...}}, got {choice!r}', "tool_choice")


def response_format(fmt: TextFormat | None) -> dict[str, Any] | None:
    """text.format as chat's response_format."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema is None:
        raise bad_request('text.format of type "json_schema" needs a schema (a JSON schema '
                          "object)", "text.format")
    schema = {"name": fmt.name or "response", "schema": fmt.schema, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": schema}
