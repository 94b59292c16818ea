"""The completions API's schemas (msgspec Structs): the request, its choices and logprobs, the
answer and the stream's chunks. The sampling fields it shares with chat are
`frontend.openai.protocol.base.SamplingRequest`'s."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from frontend.openai.protocol.base import NonNegInt, SamplingRequest, Usage
from shared.messages import MAX_LOGPROBS

Prompt = str | list[str | int | list[int]]  # as decoded; split_prompts checks the form


class CompletionRequest(SamplingRequest, kw_only=True):
    """POST /v1/completions."""

    prompt: Prompt
    echo: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    max_tokens: NonNegInt | None = None
    best_of: Annotated[int, Meta(ge=1)] | None = None
    return_tokens_as_token_ids: bool = False
    suffix: str | None = None


class CompletionLogprobs(msgspec.Struct):
    text_offset: Sequence[int]
    token_logprobs: Sequence[float | None]
    tokens: Sequence[str]
    top_logprobs: Sequence[dict[str, float] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    object: Literal["text_completion"] = "text_completion"


class CompletionStreamChunk(msgspec.Struct):
    """One SSE `data:` payload; `usage` is null except where stream_options ask for it."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"
