"""OpenAI schemas as msgspec Structs: the sampling fields both generation APIs share, usage,
and the model list. The chat schemas are in `chat.py`, the completions API's in
`frontend.openai.completions.protocol`.

`decode_request` enforces types and ranges (a violation raises `msgspec.ValidationError`, which
the error middleware answers as a 400 naming the field). The rules that cross fields or need the
model are checked once, in `frontend.openai.serving.plan`. ErrorResponse (the error body) lives with
OpenAIError in frontend.errors.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from frontend.errors import bad_request
from frontend.openai.protocol.structured import ResponseFormat, StructuredOutputsParams

MAX_N = 128
MAX_STOP_STRINGS = 64

NonNegInt = Annotated[int, Meta(ge=0)]
RequestT = TypeVar("RequestT", bound=msgspec.Struct)


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(msgspec.Struct, kw_only=True):
    """The fields completions and chat share. Unknown fields are ignored, as OpenAI's does."""

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
    response_format: ResponseFormat | None = None  # structured outputs, OpenAI's spelling
    structured_outputs: StructuredOutputsParams | None = None  # and vLLM's


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


class ModelCard(msgspec.Struct):
    id: str
    root: str
    max_model_len: int
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    owned_by: str = "tandem"
    object: Literal["model"] = "model"
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


def decode_request(body: bytes, kind: type[RequestT],
                   defaults: Mapping[str, Any] | None = None) -> RequestT:
    """Decode and type-check a request body (raises msgspec.ValidationError / DecodeError).

    An explicit JSON null means "the default", as OpenAI's API treats its nullable fields;
    `defaults` (the served model's generation defaults) replace the schema's own defaults for
    the fields the body leaves out.
    """
    raw = msgspec.json.decode(body)
    if not isinstance(raw, dict):
        raise msgspec.ValidationError("the request body must be a JSON object")
    given = {k: v for k, v in raw.items() if v is not None}
    return msgspec.convert({**(defaults or {}), **given}, kind)


def split_prompts(prompt: str | Sequence[str | int | list[int]],
                  field: str = "prompt") -> list[str] | list[list[int]]:
    """Normalise the four prompt forms to a batch: strings, or token-id lists (a 400 names
    `field`, the request's name for them: "prompt", or /v1/embeddings' "input").

    A flat list of ints is one tokenized prompt; a list of strings or of int lists is a batch.
    """
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request(f"{field} must not be empty", field)
    if all(isinstance(p, str) for p in prompt):
        return [p for p in prompt if isinstance(p, str)]
    if all(isinstance(p, int) for p in prompt):
        return [[p for p in prompt if isinstance(p, int)]]
    if all(isinstance(p, list) for p in prompt):
        return [p for p in prompt if isinstance(p, list)]
    raise bad_request(
        f"{field} must be a string, a list of strings, a list of token ids, "
        "or a list of token-id lists (not a mix)",
        field,
    )
