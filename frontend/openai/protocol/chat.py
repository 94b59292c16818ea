"""OpenAI chat-completions schemas as msgspec Structs, and the checks of chat messages.

A chat request is the shared SamplingRequest plus messages and the chat's own length and
logprobs fields; `frontend.openai.chat.endpoint` renders its messages and samples the answer
through the same planner as completions, so both APIs share one set of sampling and length
rules.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from frontend.errors import bad_request
from frontend.openai.protocol.base import SamplingRequest, Usage
from shared.messages import MAX_LOGPROBS

ROLES = ("system", "user", "assistant", "tool", "developer")

PositiveInt = Annotated[int, Meta(ge=1)]


class ContentPart(msgspec.Struct):
    """One part of a message's content; only {"type": "text", "text": ...} is supported."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # An assistant message's thinking (vLLM's name, and the older one), for templates that
    # render it (Qwen3's reads `reasoning_content`); both reach the template.
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    """POST /v1/chat/completions: the shared sampling fields, plus the chat ones."""

    messages: list[ChatMessage]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # handed to the chat template as they are
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; None:
    # "auto" with tools, else "none" (read by frontend.openai.tools.calls)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprobEntry]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON text


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ResponseMessage(msgspec.Struct):
    """The answer's message; content is null when tool calls replace it (or the thinking never
    ended), and `tool_calls` is left out of answers without any, the reasoning fields out of
    answers of a server without a reasoning parser."""

    content: str | None
    role: str = "assistant"  # --response-role
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET
    reasoning: str | None | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: str | None | msgspec.UnsetType = msgspec.UNSET  # the alias, when asked


class ChatChoice(msgspec.Struct):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A call's first delta has its id, type, name and arguments ""; later ones add arguments."""

    index: int
    function: DeltaFunctionCall
    id: str | None = None
    type: Literal["function"] | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    """What a stream chunk adds to a message: role in the first chunk only, then content,
    reasoning or tool calls."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None  # the alias, when asked


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(msgspec.Struct):
    """One SSE `data:` payload; `usage` is null except where stream_options ask for it."""

    id: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


def check_chat_request(req: ChatCompletionRequest) -> None:
    """The chat-only field rules (the messages are checked when rendered); raises a 400."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs can only be set when logprobs is true", "top_logprobs")


def check_messages(messages: list[ChatMessage]) -> None:
    """At least one message, each with a known role and text content; raises a 400."""
    if not messages:
        raise bad_request("messages must hold at least one message", "messages")
    for i, message in enumerate(messages):
        check_message(i, message)


def check_message(i: int, message: ChatMessage) -> None:
    if message.role not in ROLES:
        raise bad_request(
            f"messages[{i}].role {message.role!r} is not supported "
            f"(use one of {', '.join(ROLES)})",
            "messages",
        )
    if message.content is None and not (message.role == "assistant" and (
            message.tool_calls or message.reasoning or message.reasoning_content)):
        raise bad_request(f"messages[{i}].content is required", "messages")
    if isinstance(message.content, list):
        for part in message.content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                    f"are supported, got type {part.type!r}",
                    "messages",
                )


def max_completion_tokens(req: ChatCompletionRequest) -> int | None:
    """The completion budget asked: max_completion_tokens wins over the older max_tokens."""
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def top_logprobs(req: ChatCompletionRequest) -> int | None:
    """Top alternatives per token the answer shows, or None when logprobs were not asked."""
    return (req.top_logprobs or 0) if req.logprobs else None
