"""OpenAI chat-completions schemas as msgspec Structs, and the chat request checks.

A chat request is validated here (roles, content parts, logprobs fields), then its rendered
prompt runs through the completions machinery: `to_completion_request` carries every sampling
field over, so both APIs share one set of sampling and length rules.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from frontend.errors import bad_request
from frontend.protocol import (
    MAX_LOGPROBS,
    CompletionRequest,
    SamplingRequest,
    Usage,
    decode_request,
)

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


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    """POST /v1/chat/completions: the shared sampling fields, plus the chat ones."""

    messages: list[ChatMessage]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # handed to the chat template as they are


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


class ResponseMessage(msgspec.Struct):
    content: str
    role: Literal["assistant"] = "assistant"


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


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    """What a stream chunk adds to a message: role in the first chunk only, then content."""

    role: str | None = None
    content: str | None = None


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
    """The chat-only rules (the sampling ones are checked as for completions); raises a 400."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs can only be set when logprobs is true", "top_logprobs")
    if not req.messages:
        raise bad_request("messages must hold at least one message", "messages")
    for i, message in enumerate(req.messages):
        check_message(i, message)


def check_message(i: int, message: ChatMessage) -> None:
    if message.role not in ROLES:
        raise bad_request(
            f"messages[{i}].role {message.role!r} is not supported "
            f"(use one of {', '.join(ROLES)})",
            "messages",
        )
    if message.content is None and not (message.role == "assistant" and message.tool_calls):
        raise bad_request(f"messages[{i}].content is required", "messages")
    if isinstance(message.content, list):
        for part in message.content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                    f"are supported, got type {part.type!r}",
                    "messages",
                )


def content_text(content: str | list[ContentPart] | None) -> str | None:
    """A message's content as the chat template takes it: text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content
    return "\n".join(part.text or "" for part in content)


def template_messages(
    messages: list[ChatMessage], has_developer_role: bool
) -> list[dict[str, Any]]:
    """The messages as dicts for `apply_chat_template`; developer becomes system where the
    template does not know the developer role."""
    rendered = []
    for message in messages:
        item = msgspec.structs.asdict(message)
        item = {k: v for k, v in item.items() if v is not None or k == "content"}
        item["content"] = content_text(message.content)
        if message.role == "developer" and not has_developer_role:
            item["role"] = "system"
        rendered.append(item)
    return rendered


def max_completion_tokens(req: ChatCompletionRequest) -> int | None:
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def to_completion_request(req: ChatCompletionRequest, prompt_ids: list[int]) -> CompletionRequest:
    """The completion request that samples the answer to `req` from its rendered prompt."""
    return CompletionRequest(
        prompt=prompt_ids,
        model=req.model,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        max_tokens=max_completion_tokens(req),
        n=req.n,
        seed=req.seed,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=req.logit_bias,
        stop=req.stop,
        include_stop_str_in_output=req.include_stop_str_in_output,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        stream=req.stream,
        stream_options=req.stream_options,
        user=req.user,
    )


def decode_chat_request(body: bytes) -> ChatCompletionRequest:
    return decode_request(body, ChatCompletionRequest)  # type: ignore[no-any-return]
