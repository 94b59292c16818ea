"""OpenAI completions schemas as msgspec Structs, and the request checks.

Decoding a body with `decode_completion_request` enforces types and ranges (a violation raises
`msgspec.ValidationError`, which the error middleware answers as a 400 naming the field);
`check_completion_request` then applies the cross-field rules, `max_tokens_for` the length
rule. ErrorResponse (the error body) lives with OpenAIError in frontend.errors.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from frontend.errors import ErrorInfo, ErrorResponse, bad_request  # noqa: F401 (re-exported)

MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 64

NonNegInt = Annotated[int, Meta(ge=0)]
Prompt = str | list[str | int | list[int]]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(msgspec.Struct, kw_only=True):
    """The fields completions and chat share. Unknown fields are ignored, as OpenAI's server does."""

    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, le=2**63 - 1)] = 0  # the engine's wire is int64
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


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
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


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


class ModelCard(msgspec.Struct):
    id: str
    root: str
    max_model_len: int
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    owned_by: str = "tandem"
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


def decode_request(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Decode and type-check a request body (raises msgspec.ValidationError / DecodeError).

    An explicit JSON null means "the default", as OpenAI's API treats its nullable fields.
    """
    raw = msgspec.json.decode(body)
    if not isinstance(raw, dict):
        raise msgspec.ValidationError("the request body must be a JSON object")
    return msgspec.convert({k: v for k, v in raw.items() if v is not None}, kind)


def decode_completion_request(body: bytes) -> CompletionRequest:
    return decode_request(body, CompletionRequest)  # type: ignore[no-any-return]


def check_completion_request(req: CompletionRequest) -> None:
    """Cross-field rules that need no model facts; raises a 400 OpenAIError."""
    if req.suffix is not None:
        raise bad_request("suffix is not currently supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(
            f"best_of must equal n (got best_of={req.best_of}, n={req.n}): "
            "ranking several samples is not supported",
            param="best_of",
        )
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request(
            "max_tokens must be at least 1 (0 is only allowed with echo=true)", "max_tokens"
        )
    if req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise bad_request(
            f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({req.max_tokens})",
            "min_tokens",
        )
    if len(stop_strings(req)) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
    if any(s == "" for s in stop_strings(req)):
        raise bad_request("stop strings must not be empty", "stop")
    parse_logit_bias(req.logit_bias)


def max_tokens_for(req: CompletionRequest, prompt_len: int, max_model_len: int) -> int:
    """The completion budget: max_tokens, or what is left of the context when it is omitted
    (as vLLM does). Too long a request is a 400 in vLLM's words, naming both lengths."""
    limit = max_model_len
    if req.max_tokens is None:
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {prompt_len} input tokens. Please reduce the length of the input messages.",
                "prompt",
            )
        if req.min_tokens > limit - prompt_len:
            raise bad_request(
                f"min_tokens ({req.min_tokens}) must not exceed the {limit - prompt_len} tokens "
                f"left in the context after the prompt ({prompt_len} of {limit} tokens).",
                "min_tokens",
            )
        return limit - prompt_len
    if prompt_len + req.max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + req.max_tokens} tokens ({prompt_len} in the messages, "
            f"{req.max_tokens} in the completion). Please reduce the length of the messages "
            "or completion.",
            "max_tokens",
        )
    return req.max_tokens


def stop_strings(req: CompletionRequest) -> tuple[str, ...]:
    if req.stop is None:
        return ()
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)


def parse_logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """Keys are token ids written as strings; values are clamped to [-100, 100] like OpenAI."""
    if not bias:
        return None
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
            ) from None
        parsed[token_id] = min(100.0, max(-100.0, value))
    return parsed


def split_prompts(prompt: Prompt) -> list[str] | list[list[int]]:
    """Normalise the four prompt forms to a batch: strings, or token-id lists.

    A flat list of ints is one tokenized prompt; a list of strings or of int lists is a batch.
    """
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return [p for p in prompt if isinstance(p, str)]
    if all(isinstance(p, int) for p in prompt):
        return [[p for p in prompt if isinstance(p, int)]]
    if all(isinstance(p, list) for p in prompt):
        return [p for p in prompt if isinstance(p, list)]
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids, "
        "or a list of token-id lists (not a mix)",
        "prompt",
    )
