"""OpenAI Responses API schemas as msgspec Structs: the request (the stateless subset Codex CLI
and the openai-agents SDK send), the response object with its output items, and the streaming
events.

Input items stay plain JSON objects here: `frontend.openai.responses.input` reads each by its
`type` (a message may leave its type out) so that an unknown one is a 400 naming its place.
Fields Codex sends that change nothing here are accepted: `store`, `include`, `reasoning`,
`prompt_cache_key`, `client_metadata`, `metadata`, `truncation`, `service_tier`. Unknown fields
are ignored, as OpenAI's API ignores them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class TextFormat(msgspec.Struct, kw_only=True):
    """`text.format`: plain text, any JSON object, or JSON following `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted; the model decides


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """POST /v1/responses."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool = False
    user: str | None = None
    # vLLM's extra sampling fields, as on the chat API (with the SDK: extra_body)
    seed: int | None = None
    top_k: int | None = None
    logit_bias: dict[str, float] | None = None
    # Accepted and echoed or ignored (Codex CLI sends them)
    store: bool | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    client_metadata: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    truncation: str | None = None
    service_tier: str | None = None


# -- output items -------------------------------------------------------------------------------
class OutputText(msgspec.Struct, kw_only=True):
    text: str
    type: Literal["output_text"] = "output_text"
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct, kw_only=True):
    text: str
    type: Literal["reasoning_text"] = "reasoning_text"


class MessageItem(msgspec.Struct, kw_only=True):
    id: str
    content: list[OutputText]
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    type: Literal["message"] = "message"


class ReasoningItem(msgspec.Struct, kw_only=True):
    id: str
    content: list[ReasoningText]
    status: ItemStatus
    summary: list[Any] = msgspec.field(default_factory=list)
    type: Literal["reasoning"] = "reasoning"


class FunctionCallItem(msgspec.Struct, kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str  # a JSON text
    status: ItemStatus
    type: Literal["function_call"] = "function_call"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """The response: its output items, status and usage, and the request's settings echoed."""

    id: str
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    truncation: str = "disabled"
    user: str | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    object: Literal["response"] = "response"


# -- streaming events (sequence_number set as each is sent) ----------------------------------------
class ResponseEvent(msgspec.Struct, kw_only=True):
    """response.created, .in_progress, .completed, .incomplete, .failed."""

    type: str
    response: ResponseObject
    sequence_number: int = 0


class OutputItemEvent(msgspec.Struct, kw_only=True):
    """response.output_item.added / .done."""

    type: str
    output_index: int
    item: OutputItem
    sequence_number: int = 0


class ContentPartEvent(msgspec.Struct, kw_only=True):
    """response.content_part.added / .done."""

    type: str
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText
    sequence_number: int = 0


class TextDeltaEvent(msgspec.Struct, kw_only=True):
    """response.output_text.delta (with logprobs) and response.reasoning_text.delta."""

    type: str
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] | msgspec.UnsetType = msgspec.UNSET
    sequence_number: int = 0


class TextDoneEvent(msgspec.Struct, kw_only=True):
    """response.output_text.done (with logprobs) and response.reasoning_text.done."""

    type: str
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] | msgspec.UnsetType = msgspec.UNSET
    sequence_number: int = 0


class ArgumentsDeltaEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str
    sequence_number: int = 0


class ArgumentsDoneEvent(msgspec.Struct, kw_only=True):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    name: str
    arguments: str
    sequence_number: int = 0


StreamEvent = (ResponseEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent
               | TextDoneEvent | ArgumentsDeltaEvent | ArgumentsDoneEvent)
